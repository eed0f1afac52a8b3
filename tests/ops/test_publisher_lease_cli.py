"""One publisher at a time, against a live deployment (real Ray registry actor, the session's two real engines):
`versioned-lora publish` from a child process while the deployment's own Publisher (a trainer's) holds the
publisher lease is refused before it reserves (exit 4, LEASE_HELD, no begin reaches an engine, the registry
unchanged); with `--take-over` it ends the trainer's lease, publishes, and releases the lease; the trainer's old
fence is refused by the registry from then on (issue 21)."""

from __future__ import annotations

from engine_helpers import run
from ops_helpers import cli, connection_args
from test_publication_e2e import deployed

from versioned_lora.lifecycle import Rejected, Reserve, VersionKey
from versioned_lora.ops.commands import Exit
from versioned_lora.runtime.publisher import DEFAULT_HOLDER
from versioned_lora.spec.reasons import Reason

BUCKET_BYTES = 8192


def test_a_cli_publish_beside_a_trainer_is_refused_the_lease_then_takes_it_over(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            conn = connection_args(d, tmp_path)
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed  # the trainer holds the lease now
            trainer_fence = d.publisher.fence
            view = await d.registry.publication_view()
            assert (view.lease_holder, view.lease_fence) == (DEFAULT_HOLDER, trainer_fence) == (DEFAULT_HOLDER, 1)

            begins = {e: x["managed_begin"] for e, x in (await d.audit()).items()}
            before = await d.registry.state_digest()
            refused = await cli("publish", str(fixtures.adapters["B"]), "--version-id", "B",
                                "--bucket-bytes", str(BUCKET_BYTES), *conn)
            assert refused.code == Exit.REJECTED == 4, refused.stdout + refused.stderr
            assert (refused.receipt()["status"], refused.receipt()["reason"]) == ("REJECTED", "LEASE_HELD")
            assert refused.receipt()["attempt_token"] is None
            assert {e: x["managed_begin"] for e, x in (await d.audit()).items()} == begins  # no begin was sent
            assert await d.registry.state_digest() == before  # the refused acquire changed nothing

            taken = await cli("publish", str(fixtures.adapters["B"]), "--version-id", "B",
                              "--bucket-bytes", str(BUCKET_BYTES), "--take-over", "--holder", "operator", *conn)
            assert taken.code == Exit.OK, taken.stdout + taken.stderr
            assert (taken.receipt()["status"], taken.receipt()["default_revision"]) == ("COMMITTED", 2)
            assert "publisher lease taken over" in taken.stdout
            view = await d.registry.publication_view()
            assert view.default == VersionKey(d.epoch, "B")
            assert (view.lease_holder, view.lease_fence) == (None, 2)  # taken over (fence 2), then released

            # The trainer's fence died with the take-over: a reserve under it is refused by the registry.
            c_version, c = d.candidate("C")
            stale = await d.registry.submit(Reserve(c_version, c.snapshot.digest, trainer_fence))
            assert stale.result == Rejected(Reason.NOT_LEASE_HOLDER, "reserve.no_lease")
            assert c_version not in (await d.registry.publication_view()).versions

    run(body())
