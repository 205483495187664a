import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from meshpact.live.recovery import resilient, start_session

session = start_session()                       # torchrun's environment: groups, mesh, control channel
torch.manual_seed(0)                            # every rank starts from the same weights
model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
fully_shard(model, mesh=session.mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

def batch(step):                                # pure: a replay after a restore draws it again
    return torch.randint(64, (4, 17), generator=torch.Generator().manual_seed(1000 * step + session.rank))

def train_step(b):                              # your step, unchanged: one optimizer step per call
    loss = F.cross_entropy(model(b[:, :-1]).reshape(-1, 64), b[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()

with resilient(model, optimizer, session, batches=batch) as rt:
    for step in range(rt.start_step, 100):
        rt.step(train_step, batch(step))
