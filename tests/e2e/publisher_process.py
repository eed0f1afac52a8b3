"""A publisher in its own process, for the test that kills a publisher mid-attempt.

argv: registry actor name, epoch, E0 url, E1 url, token, adapter dir, Ray GCS address. It connects to
that Ray cluster, starts publishing the adapter as version "B", holds both transfers after bucket
1, prints HELD, and waits to be killed.
"""

from __future__ import annotations

import asyncio
import sys

import ray
from held_transfer import HeldAfterBucket

from versioned_lora.adapters.engine_link import Candidate
from versioned_lora.adapters.engine_staging import EngineStaging
from versioned_lora.adapters.ray_registry import REGISTRY_NAMESPACE, RayRegistry
from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
from versioned_lora.lifecycle import VersionKey
from versioned_lora.runtime.publisher import Publisher
from versioned_lora.spec.identities import lora_name

PROMPT = list(range(10, 30))


async def main(registry_name: str, epoch: int, urls: list[str], token: str, adapter_dir: str, address: str) -> None:
    ray.init(address=address, namespace=REGISTRY_NAMESPACE, log_to_driver=False, configure_logging=False)
    registry = RayRegistry.find(registry_name, REGISTRY_NAMESPACE)
    ports = {f"E{i}": HeldAfterBucket(EngineStaging(f"E{i}", SGLangClient(url, token=token), PROMPT), after=1)
             for i, url in enumerate(urls)}
    snapshot = snapshot_from_adapter_dir(adapter_dir)
    version = VersionKey(epoch, "B")
    candidate = Candidate.build(lora_name(version, snapshot.digest), snapshot, 8 * 1024)
    publisher = Publisher(registry, ports, probe_check=lambda *_: True)
    publication = asyncio.create_task(publisher.publish(version, candidate))
    await asyncio.gather(*(port.held.wait() for port in ports.values()))
    print("HELD", flush=True)
    await publication


if __name__ == "__main__":
    name, epoch, url0, url1, token, adapter, address = sys.argv[1:8]
    asyncio.run(main(name, int(epoch), [url0, url1], token, adapter, address))
