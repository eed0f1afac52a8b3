"""The managed patch's additions to SGLang's Prometheus `/metrics` (an engine started with `--enable-metrics`).

SGLang 0.5.23 serves `/metrics` from `sglang.srt.utils.common.add_prometheus_middleware` (imported into, and
called from, `sglang.srt.entrypoints.http_server`'s lifespan when metrics are enabled): a fresh
`CollectorRegistry` with a `MultiProcessCollector` over `$PROMETHEUS_MULTIPROC_DIR`, mounted at `/metrics`.
The patch replaces that function in `http_server` by one that builds the same registry and also registers
`ManagedCollector`, which reads the managed engine's own state at scrape time:

- `versioned_lora_engine_managed_adapters{state}`: managed adapters of this incarnation by engine-side state;
- `versioned_lora_engine_native_refcount{version}`: SGLang's native request refcount of each managed adapter
  still held (READY, STAGING, DRAINING, UNREGISTERED), labelled by its version id;
- `versioned_lora_engine_refusals_total{endpoint, reason}`: typed refusals of the managed endpoints and of
  requests naming managed versions.

Labels are bounded: states and reasons are enums or fixed codes, versions are the held ones (at most the
managed slots), endpoints the fixed routes. The values live in this (server) process only: nothing goes
through the multiprocess directory.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from versioned_lora.sglang_patches.mechanism import replace_attribute
from versioned_lora.spec.identities import InvalidIdentity, parse_lora_name
from versioned_lora.spec.model import SLOT_HOLDING_ADAPTER_STATES
from versioned_lora.spec.states import AdapterState
from versioned_lora.spec.wire import ENGINE_CODES, OTHER_CODE

PATCH_SET = "managed"

_refusals: Counter[tuple[str, str]] = Counter()
_lock = threading.Lock()


def count_refusal(endpoint: str, reason: object) -> None:
    # The label is one of the engine's codes (spec.wire.ENGINE_CODES) or OTHER: bounded by construction.
    code = str(reason) if str(reason) in ENGINE_CODES else OTHER_CODE
    with _lock:
        _refusals[(endpoint, code)] += 1


def refusals() -> dict[tuple[str, str], int]:
    with _lock:
        return dict(_refusals)


class ManagedCollector:
    """A prometheus_client collector over the managed engine's status (read at each scrape)."""

    def __init__(self, managed_status: Callable[[], dict[str, Any]]) -> None:
        self._status = managed_status

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        adapters = self._status()["managed"]
        by_state = GaugeMetricFamily("versioned_lora_engine_managed_adapters",
                                     "managed adapters of this engine incarnation, by engine-side state",
                                     labels=["state"])
        counts = Counter(a["state"] for a in adapters)
        for state in AdapterState:
            by_state.add_metric([str(state)], counts.get(str(state), 0))
        yield by_state
        refs = GaugeMetricFamily("versioned_lora_engine_native_refcount",
                                 "SGLang's native request refcount of each managed adapter still held",
                                 labels=["version"])
        for adapter in adapters:
            if adapter["state"] in SLOT_HOLDING_ADAPTER_STATES:
                refs.add_metric([_version_id(adapter["name"])], adapter["native_refcount"])
        yield refs
        refused = CounterMetricFamily("versioned_lora_engine_refusals",
                                      "typed refusals of managed endpoints and of requests naming managed versions",
                                      labels=["endpoint", "reason"])
        for (endpoint, reason), count in sorted(refusals().items()):
            refused.add_metric([endpoint, reason], count)
        yield refused


def _version_id(name: str) -> str:
    try:
        return parse_lora_name(name).version_id
    except InvalidIdentity:
        return OTHER_CODE


def install(managed_status: Callable[[], dict[str, Any]]) -> None:
    """Replace `http_server.add_prometheus_middleware` (stock: `sglang.srt.utils.common.add_prometheus_middleware`)
    by the same registry and mount plus `ManagedCollector`."""
    from sglang.srt.entrypoints import http_server

    def add_prometheus_middleware(app: Any) -> None:
        # As stock 0.5.23 does (prometheus_client is imported only now: after PROMETHEUS_MULTIPROC_DIR is set).
        from prometheus_client import CollectorRegistry, make_asgi_app, multiprocess
        from starlette.routing import Mount

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        registry.register(ManagedCollector(managed_status))
        route = Mount("/metrics", make_asgi_app(registry=registry))
        route.path_regex = re.compile("^/metrics(?P<path>.*)$")  # stock's workaround for the 307 redirect
        app.routes.append(route)

    replace_attribute(PATCH_SET, http_server, "add_prometheus_middleware", add_prometheus_middleware,
                      why="serve the managed engine's versioned_lora_engine_* metrics beside SGLang's own")
