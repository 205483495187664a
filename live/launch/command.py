"""``meshpact launch``'s command line: torchrun's flags read into elastic's launch config, one agent run.

:func:`main` is ``meshpact launch`` and ``python -m meshpact.launch``; :func:`config` reads
torchrun's parser with Meshpact's flags added (:func:`parser`) and refuses a command line it
cannot run in one line (:class:`~meshpact.live.launch.elastic.LaunchRefused`); :func:`launch_key`
decides the job key the workers get; :func:`launch` runs one node's agent to its end, as elastic's
``launch_agent`` does.
"""

from __future__ import annotations

import os
import sys
import uuid
from argparse import ArgumentParser, Namespace
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import _get_addr_and_port
from torch.distributed.run import config_from_args, get_args_parser, parse_min_max_nnodes

from ..recovery import jobkey
from .controlplane import CONTROL_PLANE_ENV, ControlPlaneHost, ControlPlaneRefused, control_plane_host
from .elastic import LaunchOptions, LaunchRefused, ReplacingAgent
from .nodes import HostNodeLost
from .processes import say
from .rendezvous import StandbyRendezvous, rendezvous_handler
from .spareagent import NoJobFound, SpareAgent

__all__ = ["parser", "config", "launch_key", "launch", "main", "DEFAULT_REPLACEMENTS"]

# --max-restarts when not given: replacement processes per node (torchrun's 0 would end the job at the first
# killed worker). A few: a worker that fails by itself again and again is not restarted for ever.
DEFAULT_REPLACEMENTS = 3


def parser() -> ArgumentParser:
    """torchrun's own parser (torch.distributed.run.get_args_parser), with Meshpact's flags added."""
    p = get_args_parser()
    for action in p._actions:  # torchrun's flag, with this launcher's meaning and default
        if action.dest == "max_restarts":
            action.default = DEFAULT_REPLACEMENTS
            action.help = (
                f"Replacement processes per node (default {DEFAULT_REPLACEMENTS}): a failed worker is "
                "replaced alone while any are left; 0: none, the rank is announced gone to the job."
            )
    p.prog = "meshpact launch"
    p.description = (
        "torchrun's command line; a failed worker is replaced alone, in place, while every other worker keeps running."
    )
    p.add_argument(
        "--spare-ranks-per-node",
        "--spare_ranks_per_node",
        type=int,
        default=0,
        help="Warm spares per node: interpreters with torch imported, promoted to a failed worker's rank.",
    )
    p.add_argument(
        "--warm-start",
        "--warm_start",
        action="store_true",
        help="Fork every worker (and warm spare) from one process per node that imported torch once, "
        "instead of starting a fresh interpreter per worker.",
    )
    p.add_argument(
        "--spare",
        action="store_true",
        help="Stand by as a spare node: join no rendezvous round, register with the job at "
        "--rdzv-endpoint and take the group rank of a node the job loses.",
    )
    p.add_argument(
        "--node-loss-s",
        "--node_loss_s",
        type=float,
        default=LaunchOptions.node_loss_s,
        help="A node whose agent is silent this long on the control channel is lost: its ranks are "
        "announced gone to the job.",
    )
    p.add_argument(
        "--control-plane",
        "--control_plane",
        default=os.environ.get(CONTROL_PLANE_ENV, "node"),
        metavar="{node,service}",
        help=f"Who hosts the job's rendezvous store and control channel (default: ${CONTROL_PLANE_ENV}, "
        "else node): node, group rank 0's agent (losing node 0 ends the job); service, "
        "`meshpact control-plane` at --rdzv-endpoint on a host that trains nothing (node 0 is "
        "lost as any node is).",
    )
    return p


def _control_plane(args: Namespace, given: bool) -> ControlPlaneHost:
    """``--control-plane`` (``given`` on the command line, else from the environment) read and checked
    against the rendezvous flags (:class:`LaunchRefused` in one line)."""
    flag = "--control-plane" if given or not os.environ.get(CONTROL_PLANE_ENV) else CONTROL_PLANE_ENV
    try:
        host = control_plane_host(str(args.control_plane), flag)
    except ControlPlaneRefused as exc:
        raise LaunchRefused(str(exc)) from None
    if host is ControlPlaneHost.NODE:
        return host
    _needs_c10d_endpoint(
        args,
        "--control-plane service",
        "--standalone hosts the stores on this node; drop it and name the service with "
        "--rdzv-backend c10d --rdzv-endpoint HOST:PORT",
        "--rdzv-endpoint HOST:PORT where `meshpact control-plane` serves",
    )
    return host


def _needs_c10d_endpoint(args: Namespace, flag: str, if_standalone: str, endpoint: str) -> None:
    """``flag`` serves a job of several nodes through a c10d rendezvous endpoint: refused in one line
    under ``--standalone`` (``if_standalone`` says why) or without ``--rdzv-backend c10d`` and ``endpoint``."""
    if args.standalone:
        raise LaunchRefused(f"{flag}: {if_standalone}")
    if args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        raise LaunchRefused(
            f"{flag}: expected --rdzv-backend c10d and {endpoint}, got --rdzv-backend "
            f"{args.rdzv_backend} --rdzv-endpoint {args.rdzv_endpoint or '(none)'}"
        )


def _standalone(args: Namespace) -> None:
    """``--standalone`` as torchrun reads it, with the stores on loopback (one node: nothing else needs them)."""
    args.rdzv_backend = "c10d"
    args.rdzv_endpoint = "localhost:0"
    args.rdzv_id = str(uuid.uuid4())
    if not args.local_addr:
        args.local_addr = "127.0.0.1"


def launch_key(env: Mapping[str, str], max_nodes: int) -> jobkey.JobKey | None:
    """The job key ``meshpact launch`` hands its workers: the user's (``MESHPACT_JOB_KEY`` or
    ``MESHPACT_JOB_KEY_FILE``) where set; else, for a job of one node, one drawn here; a job of
    several nodes needs the user's, the same on every node (:class:`LaunchRefused` otherwise),
    unless it opted out with ``MESHPACT_UNAUTHENTICATED=1`` (None)."""
    given = env.get(jobkey.KEY_ENV) or env.get(jobkey.KEY_FILE_ENV) or env.get(jobkey.UNAUTHENTICATED_ENV) == "1"
    if not given:
        if max_nodes <= 1:
            return jobkey.draw("drawn by meshpact launch")
        raise LaunchRefused(
            f"a job of several nodes needs one job key on every node and none was given: set "
            f"{jobkey.KEY_ENV} (64 hex digits, e.g. from `python -c 'import secrets; "
            f"print(secrets.token_hex(32))'`) or {jobkey.KEY_FILE_ENV} (a 0600 file holding them) in "
            f"every node's environment, or {jobkey.UNAUTHENTICATED_ENV}=1 to run without "
            "authentication on a trusted network"
        )
    try:
        return jobkey.load(env, "", multi_host=True)
    except jobkey.JobKeyError as exc:
        raise LaunchRefused(str(exc)) from None


def config(argv: Sequence[str]) -> tuple[Any, Any, list[str], LaunchOptions]:
    """torchrun's LaunchConfig, command and arguments for ``argv``, and Meshpact's options;
    :class:`LaunchRefused` names a bad flag in one line."""
    p = parser()
    args = p.parse_args(list(argv))
    given = any(a.split("=")[0] in ("--control-plane", "--control_plane") for a in argv)
    options = LaunchOptions(
        spare_ranks_per_node=args.spare_ranks_per_node,
        spare=args.spare,
        node_loss_s=args.node_loss_s,
        control_plane=_control_plane(args, given),
        warm_start=args.warm_start,
    )
    for flag, asked in (("--spare-ranks-per-node", options.spare_ranks_per_node), ("--warm-start", args.warm_start)):
        if asked and (args.no_python or args.run_path):
            raise LaunchRefused(
                f"{flag}: a warm process runs a Python script or module; it cannot be used with "
                "--no-python or --run-path"
            )
    if args.spare:
        _needs_c10d_endpoint(
            args,
            "--spare",
            "a spare node stands by for a job of several nodes; --standalone runs one node with "
            "nothing to take over (drop one of the two)",
            "the job's --rdzv-endpoint (a spare node finds the job in the store there)",
        )
    if args.standalone:
        _standalone(args)
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        try:
            _, max_nodes = parse_min_max_nnodes(args.nnodes)
        except (RuntimeError, ValueError):
            raise LaunchRefused(f"--nnodes {args.nnodes!r}: expected N or MIN:MAX") from None
        if max_nodes == 1:
            _standalone(args)
    if args.master_port is None:
        args.master_port = 29500
    try:
        cfg, cmd, cmd_args = config_from_args(args)
    except (AssertionError, ValueError, RuntimeError) as exc:
        raise LaunchRefused(f"{exc}") from None
    if options.apart and str(cfg.rdzv_configs.get("is_host", "")).strip().lower() in ("1", "true", "t", "yes", "y"):
        raise LaunchRefused(
            "--control-plane service: --rdzv-conf is_host=1 asks this node to host the rendezvous "
            "store, which the service hosts; drop is_host (or set it to 0)"
        )
    if not isinstance(cmd, str):
        raise LaunchRefused("--run-path is not supported by meshpact launch: name the script (python) or use -m")
    # a spare node, or a job whose control plane runs apart, shares its key with another host: never drawn here
    options = replace(options, job_key=launch_key(os.environ, 2 if options.spare or options.apart else cfg.max_nodes))
    if cfg.nproc_per_node < 1:
        raise LaunchRefused(f"--nproc-per-node {args.nproc_per_node}: expected 1 or more workers per node")
    script = args.training_script
    if not args.no_python and not args.module and not Path(script).exists():
        raise LaunchRefused(
            f"{script}: no such script (expected a Python file to run on every worker, or -m and a module name)"
        )
    return cfg, cmd, cmd_args, options


def launch(cfg: Any, cmd: str, cmd_args: list[str], options: LaunchOptions) -> dict[int, Any]:
    """Run one node's agent to the end (elastic's ``launch_agent``, with :class:`ReplacingAgent`)."""
    if not cfg.run_id:
        cfg.run_id = str(uuid.uuid4().int)
    params = RendezvousParameters(
        backend=cfg.rdzv_backend,
        endpoint=cfg.rdzv_endpoint,
        run_id=cfg.run_id,
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        local_addr=cfg.local_addr,
        **cfg.rdzv_configs,
    )
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = cfg.signals_to_handle
    standby: StandbyRendezvous | None = None
    if options.spare:  # no rendezvous handler: a spare node must neither host nor join elastic's store's rounds
        standby = StandbyRendezvous(cfg.rdzv_endpoint, cfg.run_id, float(cfg.rdzv_configs.get("join_timeout", 600)))
        handler: RendezvousHandler = standby
        master_addr, master_port = None, None
    elif options.apart:  # the service hosts the rendezvous store, and the workers share it
        handler = rendezvous_handler(params, apart=True)
        master_addr, master_port = parse_rendezvous_endpoint(cfg.rdzv_endpoint, default_port=29400)
    else:
        handler = rendezvous_handler(params)
        master_addr, master_port = _get_addr_and_port(params)
    spec = WorkerSpec(
        role=cfg.role,
        local_world_size=cfg.nproc_per_node,
        entrypoint=cmd,
        args=tuple(cmd_args),
        rdzv_handler=handler,
        max_restarts=cfg.max_restarts,
        monitor_interval=cfg.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=cfg.local_addr,
        event_log_handler=cfg.event_log_handler,
        numa_options=cfg.numa_options,
    )
    agent = (
        SpareAgent(spec, cfg.logs_specs, options, standby, shutdown_timeout=cfg.shutdown_timeout)
        if standby is not None
        else ReplacingAgent(spec, cfg.logs_specs, options, shutdown_timeout=cfg.shutdown_timeout)
    )
    shutdown_rdzv = True
    if cfg.max_nodes > 1 and not options.spare:  # it may wait a while for the others: said, not silent
        named = "" if cfg.rdzv_backend == "static" else f" {cfg.run_id}"
        say(
            f"joining the {cfg.rdzv_backend} rendezvous{named} at {cfg.rdzv_endpoint or 'MASTER_ADDR:MASTER_PORT'}"
            f" for {cfg.min_nodes}{'' if cfg.min_nodes == cfg.max_nodes else f'-{cfg.max_nodes}'} node(s) "
            f"(waits up to the rendezvous join_timeout, {cfg.rdzv_configs.get('join_timeout', 600)} s, for the others)"
        )
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(cfg.metrics_cfg))
        result = agent.run()
        if result is None:  # a spare node the job did not need (elastic's graceful exit from its rendezvous)
            return {}
        events.record(agent.get_event_succeeded(), cfg.event_log_handler)
        if result.is_failed():
            raise ChildFailedError(
                name=os.path.basename(cmd_args[1] if len(cmd_args) > 1 else cmd), failures=result.failures
            )
        return result.return_values
    except SignalException:
        shutdown_rdzv = False  # as elastic does: a signalled agent leaves the rendezvous open for the others
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """``meshpact launch ARGS`` / ``python -m meshpact.launch ARGS``: 0 when every worker finished."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg, cmd, cmd_args, options = config(args)
    except LaunchRefused as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2

    @record
    def run() -> None:
        launch(cfg, cmd, cmd_args, options)

    try:
        run()
    except ChildFailedError:
        return 1
    except (NoJobFound, HostNodeLost) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    except SignalException as exc:  # as torchrun: the workers were stopped on the way out; said in one line
        sys.stderr.write(f"meshpact launch: stopped by {exc.sigval.name}; this node's workers were stopped\n")
        return 128 + int(exc.sigval)
    return 0
