"""``meshpact live spillover``: two hosts over a shaped link, full logits against source projection."""

from __future__ import annotations

from typing import Any

import typer

from meshpact.core.errors import MeshpactError
from meshpact.core.scenario import Deployment
from meshpact.live.spillover.serving import CompileMode  # torch-free
from meshpact.commands._common import console, emit_json, err_console, table

__all__ = ["register", "parse_list"]

_MODELS = ("dense", "moe", "minimax")


def parse_list(value: str, flag: str, known: tuple[str, ...] | None = None, integer: bool = False) -> list[Any]:
    """A comma list from the command line, checked against ``known`` or parsed as positive integers."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise MeshpactError(f"{flag} {value!r}: expected a comma-separated list")
    if integer:
        try:
            nums = [int(v) for v in items]
        except ValueError:
            raise MeshpactError(f"{flag} {value!r}: expected positive integers such as 1,8,16") from None
        if any(n < 1 for n in nums):
            raise MeshpactError(f"{flag} {value!r}: expected positive integers such as 1,8,16")
        return nums
    bad = [v for v in items if known is not None and v not in known]
    if bad:
        raise MeshpactError(
            f"{flag} {value!r}: {', '.join(bad)} unknown; expected one or more of {', '.join(known or ())}"
        )
    return items


def spillover(
    model: str = typer.Option("dense,moe,minimax", "--model", help="dense, moe or minimax (a comma list runs each)."),
    concurrency: str = typer.Option("1,8,16", "--concurrency", help="Clients in flight, a comma list."),
    request: str = typer.Option(
        "full,logprob,token,owner_token",
        "--request",
        help="Requests to report; full always runs as the baseline of each pair.",
    ),
    link_gbps: float = typer.Option(1.0, "--link-gbps", help="Rate of the veth link between the hosts (tc tbf)."),
    link_delay_ms: float = typer.Option(0.0, "--link-delay-ms", help="One-way delay added with netem."),
    pairs: int = typer.Option(3, "--pairs", help="Paired runs (full vs each projected request) per row."),
    requests_per_client: int = typer.Option(3, "--requests-per-client", min=1, help="Requests each client issues."),
    output_tokens: int = typer.Option(32, "--output-tokens", min=1, help="Tokens decoded per request."),
    local_slots: int = typer.Option(4, "--local-slots", min=1, help="Sequences host 1 decodes at once."),
    remote_slots: int = typer.Option(12, "--remote-slots", min=1, help="Sequences host 2 decodes at once."),
    deployment: Deployment = typer.Option(
        Deployment.REQUESTS,
        "--deployment",
        help="requests: host 1 spills whole requests to host 2; model: the decoder is "
        "split by layers and every step crosses the link.",
    ),
    speculative: int = typer.Option(
        0,
        "--speculative",
        help="GAMMA: a draft on host 1 proposes GAMMA tokens per "
        "round, the target on host 2 verifies (with --deployment model; requests full "
        "and token).",
    ),
    compile_mode: CompileMode = typer.Option(
        CompileMode.EAGER,
        "--compile",
        help="eager: the decoders' Python steps; aoti: their steps "
        "compiled ahead of time with AOTInductor (packages cached under --work-dir).",
    ),
    work_dir: str = typer.Option(
        "", "--work-dir", help="Where compiled packages are cached (default: the system's temp dir)."
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON document (a list of rows) on stdout."),
) -> None:
    """Serve on host 1, spill to host 2 across a rate-limited veth; measure and simulate each request."""
    from meshpact.live.netns import netns_unavailable
    from meshpact.live.spillover.serving import REQUESTS, SpilloverConfig
    from meshpact.live.spillover.pairs import COLUMNS, mismatched, table_rows
    from meshpact.live.spillover.speculative import SPECULATIVE_REQUESTS
    from meshpact.spillover_sim import SPECULATIVE_COLUMNS, measure, speculative_table_rows

    models = parse_list(model, "--model", _MODELS)
    concs = parse_list(concurrency, "--concurrency", integer=True)
    reqs = parse_list(request, "--request", REQUESTS)
    deployment_name, compile_name = deployment.value, compile_mode.value
    if speculative:
        if request == "full,logprob,token,owner_token":  # the default: the requests speculation has
            reqs = list(SPECULATIVE_REQUESTS)
        SpilloverConfig(deployment=deployment_name, gamma=speculative, request=reqs[-1])  # refuses what cannot run
        bad = [r for r in reqs if r not in SPECULATIVE_REQUESTS]
        if bad:
            raise MeshpactError(
                f"--speculative with --request {','.join(bad)}: expected "
                f"{' or '.join(SPECULATIVE_REQUESTS)} (full logits, or verified at the source)"
            )
    why = netns_unavailable()
    if why:
        raise MeshpactError(f"meshpact live spillover: {why}")
    base = SpilloverConfig(
        output_tokens=output_tokens,
        local_slots=local_slots,
        remote_slots=remote_slots,
        gbit_per_s=link_gbps,
        delay_ms=link_delay_ms,
        concurrency=min(concs),
        requests=requests_per_client * min(concs),
        deployment=deployment_name,
        gamma=speculative,
        compile=compile_name,
        work_dir=work_dir,
    )
    rows = measure(
        models,
        concs,
        reqs,
        pairs,
        base,
        requests_per_client,
        progress=lambda msg: err_console.print(f"[dim]{msg}[/dim]"),
    )
    if as_json:
        emit_json(
            [
                {
                    k: v
                    for k, v in r.to_dict().items()
                    if k
                    in (
                        "model",
                        "request",
                        "concurrency",
                        "throughput_tok_s",
                        "latency_s",
                        "result_bytes",
                        "veth_bytes",
                        "startups",
                        "pairs_favouring",
                        "simulated",
                        "traffic_cut_vs_full",
                        "veth_cut_vs_full",
                        "sim_error",
                        "remote_tokens",
                        "deployment",
                        "hidden_bytes",
                        "tokens_checked",
                        "outputs_identical",
                        "first_difference",
                        "throughputs_tok_s",
                        "pair_throughputs_tok_s",
                        "outputs_as_full",
                        "speculative",
                    )
                }
                for r in rows
            ]
        )
        _refuse_mismatch(mismatched(rows))
        return
    from rich.console import Console

    wide = Console(width=max(console.width, 170))  # a wide table: keep every cell whole
    where = (
        f"{local_slots} local + {remote_slots} remote slots"
        if deployment_name == "requests"
        else "decoder split by layers: host 1 the first, host 2 the rest and the LM head"
    )
    wide.print(
        table(
            f"two hosts over a {link_gbps:g} Gbit/s veth (tc tbf), {pairs} pair(s) per row, {where}",
            COLUMNS,
            table_rows(rows),
        )
    )
    if speculative:
        wide.print(
            table(
                f"speculative decoding, draft on host 1, target on host 2, gamma {speculative}",
                SPECULATIVE_COLUMNS,
                speculative_table_rows(rows),
            )
        )
    _refuse_mismatch(mismatched(rows))


def _refuse_mismatch(bad: list[Any]) -> None:
    """A model-split run whose outputs departed from the reference fails the command (exit 1)."""
    if bad:
        err_console.print(
            f"[bold red]error:[/bold red] outputs differ from the single-process reference of the split model in "
            f"{len(bad)} row(s); first: {bad[0].model} {bad[0].request} c={bad[0].concurrency}: "
            f"{bad[0].first_difference}"
        )
        raise typer.Exit(1)


def register(groups: Any) -> None:
    groups.live.command("spillover")(spillover)
