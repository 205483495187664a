"""``meshpact plan``, ``meshpact edges``, ``meshpact transitions``: the planning core at the terminal.

``plan EDGE`` shows one edge's contract and the three planners' plans side by side with
the checker's verdict on each; ``edges`` summarises the nine real edges; ``transitions``
summarises the structural-transition enumeration. Each takes ``--json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from meshpact.commands._common import console, emit_json, err_console, table
from meshpact.core.errors import FactError
from meshpact.core.units import human_bytes

__all__ = ["register", "plan_document", "edges_document"]


def plan_document(edge: Any) -> dict[str, Any]:
    """The ``--json`` document of one edge: its contract and the three planners' plans."""
    from meshpact.core.checker import check
    from meshpact.core.contract import compile_contract
    from meshpact.core.lowerer import choose, lower_candidates
    from meshpact.core.plan import plan_cost
    from meshpact.core.planners import PLANNERS

    contract = compile_contract(edge)
    plans = {p.name: p.plan(contract) for p in PLANNERS}
    by_startups = choose(lower_candidates(contract), contract, time_first=False)
    return {
        "edge": edge.name,
        "contract": contract.to_dict(),
        "plans": {
            name: {
                "steps": [s.to_dict() for s in p.steps],
                "startups": p.startups,
                "payload_bytes": p.payload_bytes,
                "time_s": plan_cost(p, edge.mesh).time_s,
                "check": check(p, contract).to_dict(),
            }
            for name, p in plans.items()
        },
        "choice_changed_by_time": by_startups.to_json() != plans["meshpact"].to_json(),
        "startups_first": {
            "startups": by_startups.startups,
            "payload_bytes": by_startups.payload_bytes,
            "time_s": plan_cost(by_startups, edge.mesh).time_s,
        },
    }


def edges_document() -> list[dict[str, Any]]:
    from meshpact.core.edges import EDGES

    return [{**plan_document(e.edge), "result_edge": e.result_edge} for e in EDGES.values()]


def _verdict(check: dict[str, Any]) -> str:
    if check["ok"]:
        return "[green]passes[/green]"
    kinds = sorted({v["kind"] for v in check["violations"]})
    return f"[red]rejected[/red] ({', '.join(kinds)})"


def _show_plan(doc: dict[str, Any]) -> None:
    c = doc["contract"]
    prov, sub, comp, auth, dem, loc = (
        c[k] for k in ("provenance", "substitutability", "completion", "authority", "demand", "locality")
    )
    tol = sub["tolerance"]
    rows = [
        (
            "provenance",
            f"{prov['op']} -> {prov['tensor']} {prov['shape']} {prov['dtype']} {prov['placement']} on {prov['domain']}",
        ),
        (
            "substitutability",
            sub["equivalence"]
            + (f" (rtol {tol['rtol']}, atol {tol['atol']}: {tol['why']})" if tol else "")
            + "; "
            + "; ".join(f"{s['name']} {'allowed' if s['allowed'] else 'forbidden'}" for s in sub["substitutes"]),
        ),
        ("completion", "; ".join(comp["requirements"])),
        (
            "authority",
            "; ".join(f"{s['piece']} from rank {s['rank']}" for s in auth["senders"][:4])
            + (" ..." if len(auth["senders"]) > 4 else "")
            + (f"; owner scope {auth['owner_scope']}" if auth["owner_scope"] else ""),
        ),
        (
            "demand",
            f"{dem['request']}: "
            + "; ".join(f"rank {o['rank']} {o['form']} {o['region']} {o['dtype']}" for o in dem["observations"][:4])
            + (" ..." if len(dem["observations"]) > 4 else ""),
        ),
        (
            "native-domain locality",
            f"{loc['producer_domain']} -> {loc['consumer_domain']}"
            + (f" over {loc['link']}, bridge ranks {loc['bridge']}" if loc["cross_domain"] else " (same domain)"),
        ),
    ]
    console.print(table(f"Contract of {doc['edge']}", ("facet", "value"), rows))
    prefix = prov["tensor"] + "."

    def short(buf: str) -> str:
        return buf[len(prefix) :] if buf.startswith(prefix) else buf

    for name, p in doc["plans"].items():
        steps = [
            (
                i,
                s["op"],
                ",".join(map(str, s["ranks"])),
                f"{','.join(short(b) for b in s['inputs'])} -> {short(s['output'])}",
                human_bytes(s["payload_bytes"]) if s["payload_bytes"] else "",
                s["link"] or "",
                s["note"],
            )
            for i, s in enumerate(p["steps"])
        ]
        console.print(
            table(
                f"{name}: {p['startups']} startups, {human_bytes(p['payload_bytes'])}",
                ("#", "op", "ranks", "reads -> writes", "bytes", "link", "note"),
                steps,
            )
        )
        console.print(f"  checker: {_verdict(p['check'])}")
        vs = p["check"]["violations"]
        for v in vs[:6]:
            console.print(f"   - {v['kind']} (step {v['step']}, rank {v['rank']}): {v['reason']}")
        if len(vs) > 6:
            console.print(f"   ... and {len(vs) - 6} more (--json lists them all)")
        console.print()


def plan(
    edge: Optional[str] = typer.Argument(None, help="Edge name (see `meshpact edges`)."),
    facts: Optional[Path] = typer.Option(None, "--facts", help="Plan an edge described in a YAML or JSON file."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    run: Optional[Path] = typer.Option(
        None,
        "--run",
        help="Interpret the meshpact plan on these values: a .npy "
        "file or a JSON array of the producer's whole tensor (Partial: the addends).",
    ),
) -> None:
    """Show an edge's contract and the meshpact, layout-only and byte-only plans with verdicts.

    With --run VALUES, interpret the meshpact plan on VALUES and show, per consumer rank, what
    it observes, the reference and the verdict. Exits 1 when the checker rejects the meshpact
    plan or a rank observes the wrong thing, 2 for facts or values that cannot be used."""
    from meshpact.core.edges import get_edge
    from meshpact.core.factsfile import load_edge_facts

    if facts is not None and edge is not None:
        raise FactError("give either an edge name or --facts FILE, not both")
    if facts is None and edge is None:
        from meshpact.core.edges import EDGES

        raise FactError(f"name an edge or pass --facts FILE; known edges: {', '.join(EDGES)}")
    the_edge = load_edge_facts(facts) if facts is not None else get_edge(edge or "")
    from meshpact.core.group import EdgeGroup

    if isinstance(the_edge, EdgeGroup):
        _plan_group(the_edge, as_json, run)
        return
    if run is not None:
        _run_values(the_edge, run, as_json)
        return
    doc = plan_document(the_edge)
    rejected = not doc["plans"]["meshpact"]["check"]["ok"]
    if as_json:
        emit_json(doc)
        if rejected:
            raise typer.Exit(1)
        return
    if edge is not None:
        from meshpact.core.edges import get_real_edge

        real = get_real_edge(edge)
        console.print(f"[bold]{real.name}[/bold] ({real.model}): {real.edge.description}")
        console.print(f"dimensions: {real.dims}; source {real.edge.source}\n")
    _show_plan(doc)
    if rejected:
        err_console.print("the meshpact plan fails its own check (violations above); exit 1")
        raise typer.Exit(1)


def _plan_group(group: Any, as_json: bool, run: Optional[Path]) -> None:
    """Several consumers of one producer: each consumer's plan document, then the joined schedule."""
    from meshpact.core.group import plan_group

    if run is not None:
        raise FactError("--run takes a facts file with one consumer; this one lists several (consumers:)")
    joined = plan_group(group)
    docs = [plan_document(e) for e in group.edges()]
    if as_json:
        emit_json({"edge": group.name, "consumers": docs, "joined": joined.to_dict()})
    else:
        for doc in docs:
            _show_plan(doc)
        rows = [
            (
                c["consumer"],
                c["request"],
                c["startups"],
                human_bytes(c["payload_bytes"]),
                "passes" if c["check"]["ok"] else "rejected",
            )
            for c in joined.to_dict()["consumers"]
        ]
        console.print(
            table(
                f"{group.name}: one schedule for {len(rows)} consumers, {joined.plan.startups} startups, "
                f"{human_bytes(joined.plan.payload_bytes)}",
                ("consumer", "request", "startups", "payload", "checker"),
                rows,
            )
        )
    if not joined.ok:
        raise typer.Exit(1)


def _run_values(edge: Any, values: Path, as_json: bool) -> None:
    from meshpact.core.checker import check
    from meshpact.core.contract import compile_contract
    from meshpact.core.planners import planner_named
    from meshpact.core.runvalues import load_values, run_values

    contract = compile_contract(edge)
    plan = planner_named("meshpact").plan(contract)
    inputs = load_values(values, contract)
    report = run_values(plan, contract, inputs)
    checked = check(plan, contract)
    if as_json:
        emit_json({"edge": edge.name, "values": str(values), "check": checked.to_dict(), **report.to_dict()})
    else:

        def short(v: Any) -> str:
            text = str(v)
            return text if len(text) <= 60 else text[:57] + "..."

        rows = [
            (
                r.rank,
                short(r.observed),
                short(r.reference),
                "[green]right[/green]" if r.ok else "[red]wrong[/red]",
                r.reason,
            )
            for r in report.ranks
        ]
        console.print(
            table(
                f"{edge.name}: the meshpact plan on {values.name}",
                ("rank", "observed", "reference", "verdict", "why"),
                rows,
            )
        )
        if report.error:
            err_console.print(report.error)
    if not report.ok or not checked.ok:
        raise typer.Exit(1)


def edges(as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout.")) -> None:
    """Summarise the nine real edges: startups, payload bytes and verdicts of the three planners."""

    docs = edges_document()
    if as_json:
        emit_json(docs)
        return
    rows = []
    for d in docs:
        cells = []
        for k in ("meshpact", "layout_only", "byte_only"):
            p = d["plans"][k]
            kinds = sorted({v["kind"] for v in p["check"]["violations"]})
            mark = "[green]✓[/green]" if p["check"]["ok"] else "[red]✗[/red] " + ", ".join(kinds)
            cells.append(f"{p['startups']} / {human_bytes(p['payload_bytes'])} / {p['time_s'] * 1e3:.3g} ms {mark}")
        first = d["startups_first"]
        changed = (
            f"yes: was {first['startups']} / {human_bytes(first['payload_bytes'])} / {first['time_s'] * 1e3:.3g} ms"
            if d["choice_changed_by_time"]
            else ""
        )
        rows.append((d["edge"], d["contract"]["demand"]["request"], "yes" if d["result_edge"] else "", *cells, changed))
    console.print(
        table(
            "Nine real edges: startups / payload bytes / α-β time, ✓ = the checker passes the plan",
            (
                "edge",
                "request",
                "result",
                "meshpact",
                "layout-only",
                "byte-only",
                "changed by time (startups-first choice)",
            ),
            rows,
        )
    )
    console.print("Each edge's model, purpose and dimension sources: `meshpact plan EDGE`.")


def transitions(as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout.")) -> None:
    """Summarise the structural transitions: lowerer validity and what the baselines do."""
    from meshpact.core.transitions import evaluate_transitions

    report = evaluate_transitions()
    doc = report.to_dict()
    if as_json:
        emit_json(doc)
        return
    groups: dict[tuple[str, str], list[Any]] = {}
    for r in report.results:
        groups.setdefault((repr(r.transition.placement), r.transition.request.value), []).append(r)
    rows = [
        (
            pl,
            req,
            len(rs),
            sum(r.meshpact_ok for r in rs),
            sum(r.layout_only_ok for r in rs),
            sum(r.candidates for r in rs),
            sum(r.invalid for r in rs),
            sum(r.invalid_rejected for r in rs),
        )
        for (pl, req), rs in groups.items()
    ]
    console.print(
        table(
            "Structural transitions (x scope one/all ranks x same domain/same host/other host)",
            (
                "source",
                "demand",
                "cases",
                "meshpact valid",
                "layout-only complete",
                "byte-only candidates",
                "invalid",
                "invalid rejected",
            ),
            rows,
        )
    )
    console.print(table("Totals", ("measure", "count"), [(k, v) for k, v in doc.items() if k != "candidate_set"]))
    console.print(
        f"Structurally distinct: lowered plans that differ once link classes are set aside. "
        f"Candidates: {doc['candidate_set']}."
    )


def register(groups: Any) -> None:
    groups.root.command("plan")(plan)
    groups.root.command("edges")(edges)
    groups.root.command("transitions")(transitions)
