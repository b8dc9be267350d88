"""The work-unit plan: which units of which layer each rank drops. Pure data, serializable.

Role: the plan (data passed from policy to mechanism).

Glossary: a *work unit* is the granule that is resized (and later migrated): an MLP hidden unit
(one fc1 output row with its bias entry and the matching fc2 input column) or an attention head (its
q, k, v rows of linear_qkv and the matching columns of linear_proj). A *block* is the pair of GEMMs
that share units: ("mlp", layer) or ("attn", layer), with megatron-core's global 1-based layer number.
Unit indexes are local to a TP rank's shard: 0 .. units_per_rank - 1.

    plan = ResizePlan.from_dict({"blocks": {"mlp:1": {"0,1": [3, 7]}}})   # DP 0, TP 1 drops units 3, 7
    plan.dropped(("mlp", 1), dp_rank=0, tp_rank=1)                       # (3, 7)

The plan is the paper's lookup table <layer, matrix, dropped indexes>, one entry per rank. It is
identical on every rank (each rank executes its own entry) and can change between any two steps.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Literal

UnitKind = Literal["mlp", "attn"]
BlockKey = tuple[str, int]  # (kind, layer_number)
RankKey = tuple[int, int]  # (dp_rank, tp_rank)


def block_name(block: BlockKey) -> str:
    return f"{block[0]}:{block[1]}"


def parse_block_name(name: str) -> BlockKey:
    kind, _, layer = name.partition(":")
    if kind not in ("mlp", "attn") or not layer.isdigit():
        raise ValueError(f"bad block name {name!r}: expected 'mlp:<layer>' or 'attn:<layer>'")
    return kind, int(layer)


@dataclasses.dataclass(frozen=True)
class ResizePlan:
    """Per block: {(dp_rank, tp_rank): dropped units} and {(dp_rank, owner tp): {helper tp: migrated
    units}}; absent entries drop / migrate nothing. A unit is either kept, dropped, or migrated."""

    blocks: Mapping[BlockKey, Mapping[RankKey, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    migrated: Mapping[BlockKey, Mapping[RankKey, Mapping[int, tuple[int, ...]]]] = dataclasses.field(
        default_factory=dict
    )

    def dropped(self, block: BlockKey, dp_rank: int, tp_rank: int) -> tuple[int, ...]:
        return tuple(self.blocks.get(block, {}).get((dp_rank, tp_rank), ()))

    def migrations(self, block: BlockKey, dp_rank: int) -> dict[tuple[int, int], tuple[int, ...]]:
        """{(owner tp, helper tp): units} of one DP replica's TP group, in a fixed order."""
        out = {}
        for (dp, owner), helpers in sorted(self.migrated.get(block, {}).items()):
            if dp == dp_rank:
                out.update({(owner, h): tuple(units) for h, units in sorted(helpers.items()) if units})
        return out

    def migrated_away(self, block: BlockKey, dp_rank: int, tp_rank: int) -> tuple[int, ...]:
        """Units this rank owns but a helper computes."""
        helpers = self.migrated.get(block, {}).get((dp_rank, tp_rank), {})
        return tuple(sorted(u for units in helpers.values() for u in units))

    def compute_counts(
        self,
        block: BlockKey,
        tp_rank: int,
        dp_size: int,
        num_units: int,
        weights: Sequence[int] | None = None,
    ) -> list[int]:
        """For each unit of this TP rank's shard: how many DP replicas compute it (0 .. dp_size); with
        `weights` (each replica's micro-batches, heterogeneous data parallelism), their summed weight."""
        weights = weights or [1] * dp_size
        counts = [sum(weights)] * num_units
        for dp_rank in range(dp_size):
            for unit in self.dropped(block, dp_rank, tp_rank):
                counts[unit] -= weights[dp_rank]
        return counts

    def unit_fractions(
        self, block_units: Mapping[BlockKey, int], dp_rank: int, tp_size: int
    ) -> dict[str, list[float]]:
        """Per TP rank of one DP replica, as fractions of its own units over all blocks: dropped,
        sent (computed by a helper) and hosted (a guest it computes for an owner)."""
        total = sum(block_units.values()) or 1
        out = {k: [0.0] * tp_size for k in ("dropped", "sent", "hosted")}
        for block in block_units:
            for tp in range(tp_size):
                out["dropped"][tp] += len(self.dropped(block, dp_rank, tp)) / total
            for (owner, helper), units in self.migrations(block, dp_rank).items():
                out["sent"][owner] += len(units) / total
                out["hosted"][helper] += len(units) / total
        return out

    @property
    def is_empty(self) -> bool:
        dropped = any(units for ranks in self.blocks.values() for units in ranks.values())
        return not dropped and not any(
            self.migrations(b, dp) for b, r in self.migrated.items() for dp, _ in r
        )

    def to_dict(self) -> dict:
        out = {
            "blocks": {
                block_name(block): {f"{dp},{tp}": list(units) for (dp, tp), units in ranks.items() if units}
                for block, ranks in sorted(self.blocks.items())
            }
        }
        migrated = {
            block_name(block): {
                f"{dp},{tp}": {str(h): list(u) for h, u in sorted(helpers.items()) if u}
                for (dp, tp), helpers in sorted(owners.items())
                if any(helpers.values())
            }
            for block, owners in sorted(self.migrated.items())
        }
        if any(migrated.values()):
            out["migrated"] = {k: v for k, v in migrated.items() if v}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> ResizePlan:
        blocks = {}
        for name, ranks in data.get("blocks", {}).items():
            entry = {}
            for key, units in ranks.items():
                dp, _, tp = key.partition(",")
                indexes = sorted(int(u) for u in units)
                if len(set(indexes)) != len(indexes) or (indexes and indexes[0] < 0):
                    raise ValueError(
                        f"plan entry {name} [{key}] must list distinct non-negative units, got {units}"
                    )
                entry[(int(dp), int(tp))] = tuple(indexes)
            blocks[parse_block_name(name)] = entry
        migrated = {}
        for name, owners in data.get("migrated", {}).items():
            block = parse_block_name(name)
            entry = {}
            for key, helpers in owners.items():
                dp, _, tp = key.partition(",")
                entry[(int(dp), int(tp))] = {
                    int(h): tuple(sorted(int(u) for u in units)) for h, units in helpers.items()
                }
                moved = [u for units in entry[(int(dp), int(tp))].values() for u in units]
                dropped = set(blocks.get(block, {}).get((int(dp), int(tp)), ()))
                if len(set(moved)) != len(moved) or (moved and min(moved) < 0) or dropped & set(moved):
                    raise ValueError(
                        f"plan migrates units of {name} [{key}] twice, negative, or also dropped: {helpers}"
                    )
                if int(tp) in entry[(int(dp), int(tp))]:
                    raise ValueError(f"plan entry {name} [{key}] migrates units to their own owner")
            migrated[block] = entry
        return cls(blocks, migrated)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ResizePlan:
        return cls.from_dict(json.loads(text))
