"""Routing by prefix: send a request to the replica whose prefix cache already holds its first blocks.

Every replica keeps its own prefix cache (stage 05). Ray Serve's default router picks the less loaded of
two replicas at random, so a system prompt shared by many requests ends up prefilled, and cached, on every
replica: each replica misses it once, and together the R caches hold no more distinct prefixes than one of
them, since each holds the same popular ones. Once the prefixes outnumber what a cache holds, the misses
never stop. This router remembers, for each chained block hash (the very digests stage 05's HashIndex
computes), which replica it last sent that block to, and sends the next request with the same first
blocks there, so that each prefix lives on one replica and the fleet's caches add up.

Affinity alone would pile every request of a popular prefix on one replica. The load guard keeps the
choice honest: draw two other replicas at random (the power of two choices) and if the preferred one
holds more than ``imbalance`` requests beyond the less loaded of the two, go there instead. That replica
then holds the prefix too, and later requests spread over both. The loads are what Ray Serve counts for each
replica, never more than its ``max_ongoing_requests``: the guard can move a request off a full owner only if
``imbalance`` is smaller than that (16 against 96, by default).

The gateway computes the hashes (it has the tokenizer) and passes them as the ``prefix_hashes`` keyword of
the call; the router, which runs in the gateway's process inside Ray Serve, reads them from the pending
request and ranks the replicas. Ray Serve does the rest: it asks the replicas of the first rank whether they
have room (``max_ongoing_requests``), tries the next rank if none has, and keeps the request waiting at the
gateway, asking again, when no rank has room. The owner of a prompt's first blocks is its only rank: the
request waits for that replica rather than prefill its prompt on another, unless the load guard says the
wait is too long. A request without an owner (no match, or the guard moved it) takes any replica with room,
the less loaded first.

When requests wait at the gateway, which replica each one gets is a second decision, and Ray Serve makes it
outside ``choose_replicas``: a routing task that found a replica with room hands it to a waiting request in
``_fulfill_next_pending_request``. The base ``RequestRouter`` hands it to the very request it ranked the
replicas for (matched by ``internal_request_id``). ``FIFOMixin`` overrides that to hand it to the oldest
waiting request, whatever its prompt: right for the power of two choices, for which any replica with room
is as good as another, wrong for this router, whose choice is about the prompt. This router leaves the mixin
out, as Ray's own ``PrefixCacheAffinityRouter`` (ray.llm) does.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

DEFAULT_IMBALANCE = 16
DEFAULT_CAPACITY = 100_000  # block hashes remembered (32 bytes each, with their owner: a few MB)
# A shorter match is not worth a replica's load: a chat template's own opening (SmolLM2's adds a default system
# prompt of about 20 tokens to every chat without one) would otherwise herd every plain chat onto one replica.
MIN_MATCH_BLOCKS = 4


class PrefixOwners:
    """Which replica each block hash was last sent to, the least recently used forgotten first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[bytes, Hashable] = OrderedDict()

    def longest_match(self, hashes: Sequence[bytes], among: Mapping[Hashable, Any]) -> tuple[Hashable | None, int]:
        """The replica (one of ``among``) that was sent the longest run of the prompt's first blocks, and
        how many blocks that run holds; (None, 0) if none of them was sent even the first one."""
        # A chained hash names the whole prefix up to its block: a match at depth d is a match of all d, so the
        # deepest hash whose replica is still a candidate wins (a shallower one may name a replica since gone).
        for depth in range(len(hashes), 0, -1):
            replica = self._owner.get(hashes[depth - 1])
            if replica is not None and replica in among:
                return replica, depth
        return None, 0

    def record(self, hashes: Sequence[bytes], replica: Hashable) -> None:
        for digest in hashes:
            self._owner[digest] = replica
            self._owner.move_to_end(digest)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """A replica is gone: its cache went with it."""
        for digest in [d for d, owner in self._owner.items() if owner == replica]:
            del self._owner[digest]

    def __len__(self) -> int:
        return len(self._owner)


def prefer(hashes: Sequence[bytes], owners: PrefixOwners, loads: Mapping[Hashable, int], imbalance: int,
           rng: random.Random, min_blocks: int = MIN_MATCH_BLOCKS) -> tuple[Hashable, str]:
    """The replica to try first, and why: ``"prefix"`` (it holds the longest run of the prompt's first
    blocks, at least ``min_blocks`` of them), ``"imbalance"`` (it does, but holds more than ``imbalance``
    requests beyond the less loaded of two others drawn at random, which gets the request), ``"no_match"``
    (no replica holds ``min_blocks`` of them: the less loaded of two at random, as Ray Serve's default
    router does).

    ``loads``: every candidate replica and the requests it holds (running and queued)."""
    assert loads, "no replica to choose from"
    ### BEGIN SOLUTION 12.1
    owner, matched = owners.longest_match(hashes, among=loads)
    if matched < min_blocks:
        owner = None
    others = [replica for replica in loads if replica != owner]
    if not others:  # the only replica
        return owner, "prefix"
    drawn = rng.sample(others, min(2, len(others)))
    least = min(drawn, key=lambda replica: loads[replica])
    if owner is None:
        return least, "no_match"
    if loads[owner] - loads[least] > imbalance:
        return least, "imbalance"
    return owner, "prefix"
    ### END SOLUTION


class PrefixAwareRouter(RequestRouter):
    """A Ray Serve request router that ranks first the replica ``prefer`` picks. Without ``FIFOMixin``: a
    replica found for one request's prompt goes to that request, not to the oldest one waiting."""

    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, capacity: int = DEFAULT_CAPACITY,
                         seed: int | None = None) -> None:
        self.imbalance = imbalance
        self.owners = PrefixOwners(capacity)
        self.rng = random.Random(seed)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """The ranks Ray Serve tries in turn, each a list of replicas (it takes the less loaded of a rank's
        replicas that have room). ``"prefix"``: the owner alone, the request waits for it. Otherwise the
        replica ``prefer`` picked, then every other candidate, the less loaded first. Ray Serve calls this
        again after each round in which no rank had room, so a request waiting for its owner is moved as soon
        as the load guard says so."""
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Ray Serve sleeps between two rounds without room only if the router asks it to (its locality and
            # multiplex mixins do, this router has neither): otherwise its routing tasks probe the full replicas
            # without pause, thousands of times a second, and take the CPU the replicas decode with.
            pending_request.routing_context.should_backoff = True
        ### BEGIN SOLUTION 12.4
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        # What this router last heard of each replica's requests (it updates on every send and every probe);
        # None: nothing recent, counted as idle.
        loads = {rid: self.replica_queue_len_cache.get(rid) or 0 for rid in by_id}
        first, reason = prefer(prefix_hashes(pending_request), self.owners, loads, self.imbalance, self.rng)
        if reason == "prefix":
            return [[by_id[first]]]
        rest = sorted((replica for rid, replica in by_id.items() if rid != first),
                      key=lambda replica: loads[replica.replica_id])
        return [[by_id[first]], rest]
        ### END SOLUTION

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Wherever the request went (its owner, or any replica with room when it had none), that replica
        now holds its prefix."""
        self.owners.record(prefix_hashes(pending_request), replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.owners.forget(replica_id)


def prefix_hashes(pending_request: PendingRequest | None) -> list[bytes]:
    """The block hashes the gateway passed with the call (none for a call that is not a generation)."""
    if pending_request is None:
        return []
    return pending_request.kwargs.get("prefix_hashes") or []
