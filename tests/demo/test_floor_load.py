"""The publication floor's native load (issue 9): SGLang's stock load from tensors, with the tensors sent by
value, serves exactly what the stock load of the same adapter from its directory serves. Asserts outcomes,
never timings."""

from __future__ import annotations

from engine_helpers import PROMPT, client_for, fresh_name, run

from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
from versioned_lora.demo.floor import native_load_and_probe


def test_floor_load_from_tensors_serves_what_the_directory_load_serves(engines, fixtures) -> None:  # type: ignore[no-untyped-def]
    snapshot = snapshot_from_adapter_dir(fixtures.adapters["B"])

    async def body() -> None:
        async with client_for(engines.e0) as client:
            from_tensors, from_dir = fresh_name("floor-tensors"), fresh_name("floor-dir")
            loaded = await client.load_lora_adapter_from_tensors(from_tensors, snapshot.tensors,
                                                                 snapshot.adapter_config())
            assert loaded.get("success"), loaded
            assert (await client.load_lora_adapter(from_dir, str(fixtures.adapters["B"]))).get("success")
            try:
                a = await client.generate(PROMPT, from_tensors, 1)
                b = await client.generate(PROMPT, from_dir, 1)
                assert a.output_ids == b.output_ids and a.logprobs == b.logprobs
            finally:
                await client.unload_lora_adapter(from_tensors)
                await client.unload_lora_adapter(from_dir)
            names = {a["name"] for a in (await client.status())["adapters"]}
            # The floor's own measurement (here on one engine) unloads its fresh name again.
            load_s, probe_s = await native_load_and_probe([client], snapshot, PROMPT)
            assert load_s > 0 and probe_s > 0
            assert {a["name"] for a in (await client.status())["adapters"]} == names

    run(body())
