"""Rich tables of the rows `status_view.status_rows` builds (the terminal form of `versioned-lora status`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

STATE_STYLE = {"PUBLISHED": "green", "READY": "green", "RETIRED": "cyan", "LOADING": "yellow", "STAGING": "yellow",
               "RECLAIMING": "magenta", "DRAINING": "magenta", "UNREGISTERED": "magenta", "ABORTED": "red",
               "UNKNOWN": "bold red", "CLEANING": "yellow", "RECLAIMED": "dim", "FAILED_CLEAN": "dim",
               "CLEANED": "dim", "UNLOADED": "dim", "ABSENT": "dim"}


def _state(state: str | None) -> Text:
    if state is None:
        return Text("-", style="dim")
    return Text(state, style=STATE_STYLE.get(state, ""))


def versions_table(rows: Mapping[str, Any]) -> Table:
    registry = rows["registry"]
    default = registry["default"]
    capacity = registry["capacity"]
    lease = registry["lease"]
    held = (f"{lease['holder']} (fence {lease['fence']}"
            + (f", {lease['expires_in_s']:.0f} s left)" if lease["expires_in_s"] is not None else ")")
            if lease["holder"] else "free")
    title = (f"registry  epoch {registry['epoch']}  default "
             f"{default['version_id'] if default else '-'} (revision {registry['default_revision']})  "
             f"capacity {capacity['used']}/{capacity['total']}  open sessions {registry['open_sessions']}  "
             f"publisher lease {held}")
    left_out = registry.get("versions_left_out", 0)
    caption = f"{left_out} older ended version(s) not shown (status --all)" if left_out else None
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for column in ("version", "state", "digest", "refs", "attempt", *registry["engines"]):
        table.add_column(column)
    for v in rows["versions"]:
        placements = [v["placements"].get(e) for e in registry["engines"]]
        table.add_row(
            ("* " if v["default"] else "  ") + v["version_id"], _state(v["state"]), v["digest_prefix"],
            str(v["session_refs"]), v["attempt_token"],
            *(Text("-", style="dim") if p is None else _state(p["state"]) for p in placements),
        )
    return table


def reclaims_table(rows: Mapping[str, Any]) -> Table | None:
    if not rows["reclaims"]:
        return None
    table = Table(title="reclaims in progress", title_justify="left")
    for column in ("version", "reclaim id", *rows["registry"]["engines"]):
        table.add_column(column)
    for r in rows["reclaims"]:
        cells = [Text(f"confirmed ({e['managed_state'] or '-'})", style="green") if e["confirmed"]
                 else Text(f"waiting ({e['managed_state'] or '-'})", style="magenta") for e in r["engines"].values()]
        table.add_row(r["version_id"], r["reclaim_id"] or "-", *cells)
    return table


def engines_table(rows: Mapping[str, Any]) -> Table:
    left_out = sum(e.get("adapters_left_out", 0) for e in rows["engines"])
    table = Table(title="engines", title_justify="left", caption_justify="left",
                  caption=f"{left_out} unloaded adapter(s) of older versions not shown (status --all)" if left_out
                  else None)
    for column in ("engine", "incarnation", "adapter", "lora_id", "pinned", "native refs", "managed state"):
        table.add_column(column)
    for e in rows["engines"]:
        if not e["reachable"]:
            table.add_row(e["name"], Text("unreachable", style="bold red"), e["error"] or "", "", "", "", "")
            continue
        stale = e["registry_incarnation"] is not None and e["incarnation"] != e["registry_incarnation"]
        incarnation = Text(str(e["incarnation"]), style="bold red" if stale else "")
        if not e["adapters"]:
            table.add_row(e["name"], incarnation, Text("(none)", style="dim"), "", "", "", "")
        for index, a in enumerate(e["adapters"]):
            table.add_row(e["name"] if index == 0 else "", incarnation if index == 0 else "", a["name"],
                          str(a["lora_id"] or "-")[:12], "yes" if a["pinned"] else "no",
                          str(a["native_refcount"] if a["native_refcount"] is not None else "-"),
                          _state(a["managed_state"]))
    return table


def blocking_table(rows: Mapping[str, Any]) -> Table | Text:
    if not rows["blocking"]:
        return Text("nothing blocks the next publication", style="green")
    table = Table(title="blocks the next publication", title_justify="left", title_style="bold red")
    for column in ("kind", "detail", "run"):
        table.add_column(column)
    for b in rows["blocking"]:
        table.add_row(Text(b["kind"], style="bold red"), b["detail"], b["run"])
    return table


def render_status(rows: Mapping[str, Any]) -> Group:
    parts: list[Any] = [versions_table(rows)]
    reclaims = reclaims_table(rows)
    if reclaims is not None:
        parts.append(reclaims)
    parts += [engines_table(rows), blocking_table(rows)]
    return Group(*parts)
