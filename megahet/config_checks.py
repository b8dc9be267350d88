"""Checks of a whole configuration against the world size, before any rank starts work: every bad value
is a one-line `ConfigError` that names the key and the fix.

Role: configuration (validation, before any rank starts).

    dp = validate(load_config(argv), world_size=8)   # the data-parallel size
"""

from __future__ import annotations

import math
import os

from megahet.config import ConfigError, MegahetConfig
from megahet.parallel import check_world_size
from megahet.policy.declared_speeds import parse_declared_speeds
from megahet.policy.resize_planner import parse_block_gammas, parse_migrations, parse_rank_gammas
from megahet.policy.speed_profile import parse_collective_delays, parse_profile
from megahet.policy.stage_split import StageSplit, best_split, parse_stage_layers


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(cfg: MegahetConfig, world_size: int) -> int:
    """Check the whole configuration against the world size; returns the data-parallel size."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        _require(getattr(m, key) > 0, f"model.{key} must be positive, got {getattr(m, key)}")
    _require(p.tp >= 1 and p.pp >= 1, f"parallel.tp and parallel.pp must be >= 1 (got {p.tp}, {p.pp})")
    _require(
        m.hidden_size % m.num_attention_heads == 0,
        f"model.hidden_size {m.hidden_size} is not divisible by model.num_attention_heads "
        f"{m.num_attention_heads}: pick a head count that divides it",
    )
    _require(
        m.num_attention_heads % p.tp == 0,
        f"parallel.tp {p.tp} does not divide model.num_attention_heads {m.num_attention_heads}: "
        f"use a TP size that divides the head count",
    )
    # TP divides the heads and the heads divide hidden_size, so TP divides hidden_size too.
    _require(
        m.ffn_hidden_size is None or m.ffn_hidden_size > 0,
        f"model.ffn_hidden_size must be positive, got {m.ffn_hidden_size} (leave it unset for 4 * hidden_size)",
    )
    _require(
        m.ffn_size % p.tp == 0,
        f"parallel.tp {p.tp} does not divide the MLP size {m.ffn_size} (model.ffn_hidden_size, default "
        f"4 * hidden_size): use a TP size that divides it or set model.ffn_hidden_size",
    )
    _validate_architecture(cfg)
    _validate_stage_layers(cfg)
    dp = check_world_size(world_size, p.tp, p.pp, p.cp)
    _validate_context_parallel(cfg)
    _require(p.zero_stage in (1, 2), f"parallel.zero_stage must be 1 or 2, got {p.zero_stage}")
    _require(
        not (p.zero_stage == 2 and p.pp > 1),
        f"ZeRO stage 2 does not support pipeline parallelism (pp={p.pp}): "
        f"use parallel.zero_stage=1 with pp > 1, or pp=1",
    )
    _require(t.micro_batch_size > 0, f"train.micro_batch_size must be positive, got {t.micro_batch_size}")
    _require(t.global_batch_size > 0, f"train.global_batch_size must be positive, got {t.global_batch_size}")
    if cfg.data.packing == "documents":
        _validate_packing(cfg, dp)
    else:
        for key in ("max_tokens", "doc_cost", "replica_max_tokens"):
            _require(
                getattr(cfg.data, key) is None,
                f"data.{key} applies to packed documents only: set data.packing=documents or leave it unset",
            )
        _require(
            t.global_batch_size % (t.micro_batch_size * dp) == 0,
            f"train.global_batch_size {t.global_batch_size} is not a multiple of micro_batch_size * DP = "
            f"{t.micro_batch_size} * {dp}: change one of them",
        )
        _require(
            t.global_batch_tokens is None,
            "train.global_batch_tokens sizes packed batches: set data.packing=documents or unset it",
        )
    _require(t.train_iters > 0, f"train.train_iters must be positive, got {t.train_iters}")
    for key in ("log_interval", "eval_interval", "eval_iters"):
        _require(getattr(t, key) > 0, f"train.{key} must be positive, got {getattr(t, key)}")
    _require(
        t.lr > 0 and t.min_lr >= 0, f"train.lr must be > 0 and train.min_lr >= 0 (got {t.lr}, {t.min_lr})"
    )
    _require(
        t.min_lr <= t.lr,
        f"train.min_lr {t.min_lr} is above train.lr {t.lr}: the schedule decays from lr to min_lr; lower min_lr",
    )
    for key in ("save_interval", "keep_last"):
        _require(getattr(t, key) >= 0, f"train.{key} must be >= 0, got {getattr(t, key)}")
    _require(
        not (t.save_interval and not t.save),
        f"train.save_interval {t.save_interval} needs train.save (the checkpoint directory)",
    )
    _validate_resize(cfg, dp)
    _validate_device(cfg, world_size)
    b = cfg.balance
    _require(b.interval > 0 and b.window > 0, "balance.interval and balance.window must be positive")
    _require(
        not (b.migrates and p.zero_stage == 2),
        f"balance.mode={b.mode} migrates units and needs ZeRO-1: set parallel.zero_stage=1",
    )
    _validate_hetero(cfg, world_size, dp)
    _validate_escalate(cfg, world_size)
    return dp


def _validate_escalate(cfg: MegahetConfig, world_size: int) -> None:
    e, p = cfg.escalate, cfg.parallel
    _require(e.patience >= 1, f"escalate.patience must be >= 1 steps, got {e.patience}")
    _require(e.horizon >= 1, f"escalate.horizon must be >= 1 steps, got {e.horizon}")
    _require(e.window >= 1, f"escalate.window must be >= 1 steps, got {e.window}")
    _require(0 <= e.min_gain < 1, f"escalate.min_gain must be in [0, 1), got {e.min_gain}")
    _require(e.delay_floor_ms >= 0, f"escalate.delay_floor_ms must be >= 0, got {e.delay_floor_ms}")
    _require(e.memory_gib >= 0, f"escalate.memory_gib must be >= 0 GiB (0: the GPU's), got {e.memory_gib}")
    if not e.active:
        return
    _require(world_size > 1, "escalate.mode=on moves between layouts of several ranks: launch 2 or more")
    _require(
        p.pp == 1 and p.cp == 1,
        f"escalate.mode=on moves between TP x DP layouts (PP 1, CP 1), got PP {p.pp}, CP {p.cp}: set "
        "parallel.pp=1 and parallel.cp=1, or escalate.mode=off",
    )
    _require(
        cfg.data.packing != "documents",
        "escalate.mode=on does not plan packed documents yet: set data.packing=none or escalate.mode=off",
    )
    _require(
        p.zero_stage == 1,
        "escalate.mode=on gives the moved-to replicas measured shares, which need ZeRO-1: set parallel.zero_stage=1",
    )
    _require(
        not cfg.balance.replay,
        "escalate.mode=on changes the layout a balance.replay trace was recorded on: drop one of them",
    )


def parse_doc_cost(text: str) -> tuple[float, float, float]:
    """'A,B,C' -> (a, b, c): seconds per token^2, per token and per micro-batch (data.doc_cost)."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(math.isfinite(v) and v >= 0 for v in values) or values[0] + values[1] <= 0:
        raise ConfigError(
            f"data.doc_cost {text!r} must be 'A,B,C': three finite numbers >= 0 (seconds per token^2, per token, per "
            f"micro-batch) with A + B > 0, e.g. 2e-9,1e-5,1e-3; or leave it unset to profile at start-up"
        )
    return values


def packing_cap(cfg: MegahetConfig) -> int:
    """Tokens per packed micro-batch: data.max_tokens, default model.seq_length."""
    return cfg.data.max_tokens if cfg.data.max_tokens is not None else cfg.model.seq_length


def replica_caps(cfg: MegahetConfig, dp: int) -> tuple[int, ...]:
    """The token cap of each DP replica's micro-batches: data.replica_max_tokens, else data.max_tokens each."""
    text = cfg.data.replica_max_tokens
    if text is None:
        return (packing_cap(cfg),) * dp
    try:
        caps = tuple(int(x) for x in text.split(","))
    except ValueError:
        caps = ()
    if len(caps) != dp or min(caps) < 2:
        raise ConfigError(
            f"data.replica_max_tokens {text!r} must give {dp} token caps of at least 2, one per data-parallel "
            f"replica (e.g. {','.join(['2048'] * dp)}); leave it unset for data.max_tokens everywhere"
        )
    return caps


def _validate_packing(cfg: MegahetConfig, dp: int) -> None:
    """data.packing=documents: whole documents per micro-batch row, attention that takes document masks."""
    d, m, t = cfg.data, cfg.model, cfg.train
    caps = replica_caps(cfg, dp)
    cap = max(caps)
    _require(
        t.micro_batch_size == 1,
        f"data.packing=documents packs documents into one row per micro-batch: set train.micro_batch_size 1 "
        f"(got {t.micro_batch_size}; data.max_tokens sets the tokens per micro-batch)",
    )
    _require(packing_cap(cfg) >= 2, f"data.max_tokens must be at least 2, got {packing_cap(cfg)}")
    _require(
        len(set(caps)) == 1 or d.packing_strategy == "cost",
        f"data.replica_max_tokens gives replicas different caps; data.packing_strategy={d.packing_strategy} "
        f"plans one cap for all: use data.packing_strategy cost",
    )
    _require(
        dp == 1 or cfg.parallel.zero_stage == 1,
        "data.packing=documents gives replicas different numbers of micro-batches, but ZeRO-2 reduces "
        "gradients in every backward pass, so every replica must run as many: set parallel.zero_stage=1",
    )
    _require(
        m.attention == "sdpa",
        f"data.packing=documents needs attention that takes document boundaries: model.attention={m.attention} "
        f"runs one mask over the whole row; set model.attention sdpa",
    )
    _require(
        m.attention_dropout == 0.0,
        f"packed attention runs without dropout (the varlen kernel has none): set model.attention_dropout 0 "
        f"(got {m.attention_dropout})",
    )
    _require(
        m.position_embedding_type == "rope" or cap <= m.seq_length,
        f"data.max_tokens {cap} exceeds model.seq_length {m.seq_length}, the learned position table: "
        f"lower data.max_tokens (and data.replica_max_tokens) or raise model.seq_length",
    )
    if t.global_batch_tokens is not None:
        _require(
            t.global_batch_tokens >= sum(caps),
            f"train.global_batch_tokens {t.global_batch_tokens} is less than one full micro-batch per replica "
            f"({sum(caps)} = the replicas' token caps): raise it or lower data.max_tokens",
        )
    _require(
        t.global_batch_size >= dp,
        f"train.global_batch_size {t.global_batch_size} documents cannot give each of {dp} replicas one: raise it",
    )
    _require(d.packing_tries >= 0, f"data.packing_tries must be >= 0, got {d.packing_tries}")
    _require(
        d.cost_window >= 3,
        f"data.cost_window must be at least 3 (samples to fit a, b, c), got {d.cost_window}",
    )
    if d.doc_cost is not None:
        parse_doc_cost(d.doc_cost)


def parse_cp_speeds(text: str | None, cp: int) -> tuple[tuple[float, ...], bool]:
    """parallel.cp_speeds -> (one positive speed per CP rank to start from, whether they are measured):
    'S0,S1,...' declared, 'measured' (starting equal), None all 1 and fixed."""
    if text is None or str(text) == "measured":
        return (1.0,) * cp, text is not None
    try:
        speeds = tuple(float(x) for x in str(text).split(","))
    except ValueError:
        speeds = ()
    _require(
        len(speeds) == cp and all(math.isfinite(v) and v > 0 for v in speeds),
        f"parallel.cp_speeds {text!r} must list {cp} positive speeds, one per CP rank (e.g. "
        f"{','.join(['1'] * (cp - 1) + ['0.5'])}), or be 'measured'",
    )
    return speeds, False


def _validate_context_parallel(cfg: MegahetConfig) -> None:
    """parallel.cp > 1: what context parallelism runs with today (issue 45 lifts the rest)."""
    p, m = cfg.parallel, cfg.model
    if p.cp_placement == "dynamic" or p.cp_speeds is not None:
        _require(
            p.cp > 1 and p.cp_placement == "dynamic" and cfg.data.packing == "documents",
            "parallel.cp_placement dynamic (and parallel.cp_speeds) place packed documents over CP ranks: set "
            "parallel.cp > 1, parallel.cp_placement dynamic and data.packing documents",
        )
        _require(p.cp_block >= 1, f"parallel.cp_block must be a positive token count, got {p.cp_block}")
        parse_cp_speeds(p.cp_speeds, p.cp)
    if p.cp == 1:
        return
    _require(
        m.seq_length % (2 * p.cp) == 0,
        f"parallel.cp {p.cp} splits each sequence into 2 x cp = {2 * p.cp} chunks: model.seq_length "
        f"{m.seq_length} is not a multiple of {2 * p.cp}; change one of them",
    )
    _require(
        m.attention == "sdpa",
        f"parallel.cp {p.cp} needs model.attention sdpa (megatron-core's local attention refuses context "
        "parallelism): set model.attention sdpa",
    )


def _validate_architecture(cfg: MegahetConfig) -> None:
    """The Llama-family options: grouped-query attention split by TP, rotary positions on even head dims."""
    m, p = cfg.model, cfg.parallel
    if m.num_query_groups is not None:
        groups, heads = m.num_query_groups, m.num_attention_heads
        _require(groups > 0, f"model.num_query_groups must be positive, got {groups} (unset: one per head)")
        _require(
            heads % groups == 0,
            f"model.num_query_groups {groups} does not divide model.num_attention_heads {heads}: every "
            f"key/value head serves the same number of query heads; pick a divisor of {heads}",
        )
        _require(
            groups % p.tp == 0,
            f"parallel.tp {p.tp} does not divide model.num_query_groups {groups}: each TP rank needs whole "
            f"key/value heads; use a TP size that divides {groups} or more query groups",
        )
    if m.position_embedding_type != "rope":
        defaults = type(m)()
        for key in ("rotary_base", "rotary_interleaved"):
            _require(
                getattr(m, key) == getattr(defaults, key),
                f"model.{key} applies to rotary positions only: set model.position_embedding_type=rope or "
                f"leave it unset",
            )
    else:
        _require(m.rotary_base > 0, f"model.rotary_base must be positive, got {m.rotary_base}")
        head_dim = m.hidden_size // m.num_attention_heads
        _require(
            head_dim % 2 == 0,
            f"rotary positions rotate pairs of channels: the head dim {head_dim} (model.hidden_size / "
            f"model.num_attention_heads) must be even",
        )


def stage_split(cfg: MegahetConfig) -> StageSplit:
    """The layers per pipeline stage the configuration gives: parallel.stage_layers, else the even split
    (as even as whole layers allow when the split is planned: hetero.pp_split). The run's own split,
    which set-up may plan otherwise, is the run plan's (megahet/run_plan.py)."""

    m, p = cfg.model, cfg.parallel
    if p.stage_layers:
        return parse_stage_layers(p.stage_layers, m.num_layers, p.pp)
    return best_split([1.0] * p.pp, [0.0] * p.pp, m.num_layers)


def _validate_stage_layers(cfg: MegahetConfig) -> None:
    m, p = cfg.model, cfg.parallel
    _require(
        m.num_layers >= p.pp,
        f"model.num_layers {m.num_layers} cannot give each of parallel.pp {p.pp} stages one",
    )
    if p.stage_layers:
        try:
            stage_split(cfg)
        except ValueError as err:
            raise ConfigError(f"parallel.stage_layers: {err}") from None
        return
    _require(
        m.num_layers % p.pp == 0 or cfg.hetero.pp_active,
        f"parallel.pp {p.pp} does not divide model.num_layers {m.num_layers}: give the layers per stage "
        f"(parallel.stage_layers, e.g. {','.join(['1'] * (p.pp - 1) + [str(max(1, m.num_layers - p.pp + 1))])}) "
        f"or use a layer count that is a multiple of the pipeline size",
    )


def ranks_per_node(world_size: int) -> int:
    """Ranks per node as the launcher says (torchrun and deepspeed set LOCAL_WORLD_SIZE); one node if unset."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def _validate_hetero(cfg: MegahetConfig, world_size: int, dp: int) -> None:
    h = cfg.hetero
    if h.speeds:
        try:
            parse_declared_speeds(h.speeds, world_size, ranks_per_node(world_size))
        except ValueError as err:
            raise ConfigError(f"hetero.speeds: {err}") from None
    _require(
        not (h.dp_shares == "declared" and not h.speeds),
        "hetero.dp_shares=declared needs hetero.speeds (one relative speed per rank, or a nodes: file)",
    )
    _require(
        not (h.speeds and not h.active and not h.pp_active and not cfg.balance.plans),
        "hetero.speeds is declared but nothing uses it: set hetero.dp_shares=declared or measured (data-parallel "
        "shares), hetero.pp_split=declared or measured (layers per stage) and/or balance.mode (the TP plan)",
    )
    _require(
        not (h.pp_split == "declared" and not h.speeds),
        "hetero.pp_split=declared needs hetero.speeds (one relative speed per rank, or a nodes: file)",
    )
    _require(
        not (h.pp_active and cfg.parallel.pp < 2),
        f"hetero.pp_split={h.pp_split} splits the layers over pipeline stages, but parallel.pp is "
        f"{cfg.parallel.pp}: set parallel.pp >= 2 or hetero.pp_split=even",
    )
    _require(h.pp_patience > 0, f"hetero.pp_patience must be positive, got {h.pp_patience}")
    _require(h.resplit_horizon > 0, f"hetero.resplit_horizon must be positive steps, got {h.resplit_horizon}")
    _require(h.interval > 0 and h.window > 0, "hetero.interval and hetero.window must be positive")
    _require(0 <= h.healthy_gap < 1, f"hetero.healthy_gap must be in [0, 1), got {h.healthy_gap}")
    _require(0 <= h.hysteresis < 1, f"hetero.hysteresis must be in [0, 1), got {h.hysteresis}")
    _require(
        not (h.active and cfg.parallel.zero_stage == 2),
        f"hetero.dp_shares={h.dp_shares} gives replicas different numbers of micro-batches, but ZeRO-2 "
        "reduces gradients in every backward pass, so every replica must run as many: set parallel.zero_stage=1",
    )
    _require(
        not (h.active and dp < 2),
        f"hetero.dp_shares={h.dp_shares} splits the global batch over data-parallel replicas, but DP is {dp}: "
        "use more ranks (world = TP x PP x DP) or hetero.dp_shares=even",
    )


def _validate_device(cfg: MegahetConfig, world_size: int) -> None:
    d = cfg.device
    _require(d.rate_gflops > 0, f"device.rate_gflops must be positive, got {d.rate_gflops}")
    if d.profile:
        try:
            parse_profile(d.profile).check(cfg.parallel.tp, world_size)
        except ValueError as err:
            raise ConfigError(f"device.profile: {err}") from None
    if d.collective_delay_ms is not None:
        _require(
            bool(d.profile),
            "device.collective_delay_ms delays a virtual device: set device.profile too (e.g. static:1,1 for "
            "full speed)",
        )
        try:
            parse_collective_delays(d.collective_delay_ms, cfg.parallel.tp, world_size)
        except ValueError as err:
            raise ConfigError(f"device.collective_delay_ms: {err}") from None


def _validate_resize(cfg: MegahetConfig, dp: int) -> None:
    r = cfg.resize
    try:
        parse_rank_gammas(r.gamma, dp, cfg.parallel.tp)
        parse_migrations(r.migrate, dp, cfg.parallel.tp)
        blocks = parse_block_gammas(r.block_gamma)
    except ValueError as err:
        raise ConfigError(f"resize: {err}") from None
    for kind, layer in blocks:
        _require(
            1 <= layer <= cfg.model.num_layers,
            f"resize.block_gamma names {kind}:{layer}, but layers are 1..{cfg.model.num_layers}",
        )
    _require(
        not (r.migrate and cfg.parallel.zero_stage == 2),
        "resize.migrate needs ZeRO-1: ZeRO-2 reduces gradients during the backward pass, before helpers "
        "return the migrated units' gradients; set parallel.zero_stage=1",
    )
    _require(r.reselect_interval > 0, f"resize.reselect_interval must be positive, got {r.reselect_interval}")
    _require(
        r.unit_multiple is None or r.unit_multiple >= 1,
        f"resize.unit_multiple must be >= 1 (1 = no rounding; 8 or 64 on GPUs), got {r.unit_multiple}",
    )
    _require(r.max_drop_steps > 0, f"resize.max_drop_steps must be positive, got {r.max_drop_steps}")
    _require(
        r.priority_temperature >= 0,
        f"resize.priority_temperature must be >= 0 (0 = lowest scores first), got {r.priority_temperature}",
    )
    _require(0.0 <= r.score_decay < 1.0, f"resize.score_decay must be in [0, 1), got {r.score_decay}")
    _require(r.score_interval > 0, f"resize.score_interval must be positive, got {r.score_interval}")
    _require(
        r.score_samples >= 0, f"resize.score_samples must be >= 0 (0 = every element), got {r.score_samples}"
    )
