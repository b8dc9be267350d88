"""The configuration's sections as kw-only dataclasses: each field with its default and the docstring
under it (what `--help` prints).

Role: configuration (the settings, as data). Loading them from YAML and the command line is
megahet/config/loading.py; whole-config checks are megahet/config_checks.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and the fix."""


class _Section:
    """A configuration section that refuses assignments once its configuration is frozen (after
    validation: megahet/run_plan.py). What set-up decides lives in the run plan, not in the config."""

    _frozen = False

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise AttributeError(
                f"the configuration is frozen after validation: {type(self).__name__}.{name} cannot change "
                f"(set-up's decisions live in the run plan, megahet/run_plan.py)"
            )
        object.__setattr__(self, name, value)


@dataclasses.dataclass(kw_only=True)
class ModelConfig(_Section):
    num_layers: int = 4
    """Transformer layers (split over pipeline stages evenly, or as parallel.stage_layers says)."""
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None
    """MLP hidden units; None means 4 * hidden_size."""
    seq_length: int = 128
    """GPT: tokens per sample (also the number of learned positions)."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    add_bias_linear: bool = True
    """Biases in the attention and MLP linears (False: none, as in PaLM / LLaMA); LayerNorms keep theirs."""
    attention: Literal["sdpa", "local"] = "sdpa"
    """Core attention kernel: sdpa (torch's scaled_dot_product_attention: flash / cuDNN on GPUs, a fused
    kernel on CPU) or local (megatron-core's unfused DotProductAttention, scores materialized)."""
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    """GPT positions: learned_absolute (GPT-2) or rope (rotary, Llama); ViT always learns its positions."""
    rotary_base: int = 10000
    """rope: the rotary base theta (Llama 2: 10000, Llama 3: 500000)."""
    rotary_interleaved: bool = False
    """rope: rotate channel pairs (2i, 2i+1) (Meta's original Llama layout) instead of halves (i, i + d/2)
    (Hugging Face's and megatron-core's default); export-hf converts either."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """LayerNorm (GPT-2, ViT) or RMSNorm (Llama), for every norm of the model."""
    activation: Literal["gelu", "swiglu"] = "gelu"
    """MLP: gelu (GPT-2's tanh GELU) or swiglu (gated SiLU, Llama; fc1 holds the gate and up projections)."""
    num_query_groups: int | None = None
    """Grouped-query attention: key/value heads (a divisor of num_attention_heads); None: one per head."""
    untie_embeddings_and_output_weights: bool = False
    """GPT: a separate output layer instead of the input embedding's transpose (Llama)."""
    make_vocab_size_divisible_by: int = 128
    """GPT: pad the tokenizer's vocabulary to a multiple of this times TP, as Megatron does."""
    image_size: int = 28
    """ViT: input images are image_size x image_size."""
    patch_size: int = 4
    """ViT: square patches; image_size must be a multiple."""
    in_channels: int = 1
    num_classes: int = 10

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """Key/value heads: num_query_groups, or one per attention head (multi-head attention)."""
        return self.num_query_groups or self.num_attention_heads


@dataclasses.dataclass(kw_only=True)
class ParallelConfig(_Section):
    tp: int = 1
    """Tensor-parallel size: ranks that split every layer's matmuls."""
    pp: int = 1
    """Pipeline-parallel size: stages of consecutive layers (1F1B schedule)."""
    cp: int = 1
    """Context-parallel size: ranks that split every sequence (2 x cp chunks, head-tail: rank r holds chunks
    r and 2cp - 1 - r) and all-gather the keys and values per layer (megahet/models/context_parallel.py).
    Gradients are summed over CP and averaged over DP; the world is TP x CP x DP x PP (docs/context_parallel.md)."""
    cp_placement: Literal["static", "dynamic"] = "static"
    """Context parallelism with data.packing=documents: static cuts every document head-tail over the CP ranks;
    dynamic places each micro-batch's documents by predicted cost and CP rank speed, whole on one rank (no
    exchange) or cut into parallel.cp_block blocks spread over several (megahet/policy/cp_placement.py)."""
    cp_speeds: str | None = None
    """cp_placement dynamic: each CP rank's relative speed, 'S0,S1,...' (e.g. 1,0.5: rank 1 gets about half
    the work), or 'measured' (from each CP rank's compute time against its predicted work, every step, over
    balance.window steps: megahet/runtime/cp_placement.py); None: equal."""
    cp_block: int = 2048
    """cp_placement dynamic: tokens per block of a document spread over several CP ranks (measured on CPU at
    8192-token micro-batches: 2048 fastest of 512-4096, benchmarks/results/long_context_speed.md)."""
    stage_layers: str | None = None
    """Transformer layers per pipeline stage, 'L0,L1,...' (each >= 1, summing to model.num_layers), e.g.
    3,5 to give a slow first stage fewer layers; None: model.num_layers / pp each (or hetero.pp_split's)."""
    zero_stage: int = 1
    """DeepSpeed ZeRO stage for data parallelism: 1 or 2 (2 only with pp = 1)."""
    distributed_timeout_minutes: int = 10


@dataclasses.dataclass(kw_only=True)
class TrainConfig(_Section):
    micro_batch_size: int = 4
    """Samples per micro-batch per data-parallel rank."""
    global_batch_size: int = 16
    """Samples per optimizer step over all data-parallel ranks; a multiple of micro * DP. With
    data.packing=documents: documents (pieces) per step, unless train.global_batch_tokens is given."""
    global_batch_tokens: int | None = None
    """data.packing=documents: size each global batch in tokens instead (documents in order until the next
    would pass this many)."""
    train_iters: int = 300
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 20
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    precision: Literal["fp32", "bf16"] = "fp32"
    """fp32 on CPU; bf16 where the device supports it."""
    compile: bool = False
    """torch.compile each transformer layer's forward (inductor; megahet/models/compiled.py): fewer Python
    launches and fused elementwise work per layer. The first steps compile (seconds to minutes); a
    balancer's new plan recompiles the layers it changes, once."""
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 10
    """Micro-batches per data-parallel rank in one evaluation."""
    save_interval: int = 0
    """0 disables periodic checkpoints."""
    save: str | None = None
    """Checkpoint directory: saves every save_interval steps and at the end (docs/checkpoints.md)."""
    load: str | None = None
    """Resume from this checkpoint directory's latest checkpoint; when it is also train.save, a folder
    without a checkpoint means start fresh."""
    keep_last: int = 0
    """Keep only the newest N checkpoints in train.save (older ones are deleted after a save); 0 keeps all."""
    deepspeed_config: str | None = None
    """A DeepSpeed ds_config JSON merged over the one megahet builds."""


@dataclasses.dataclass(kw_only=True)
class DataConfig(_Section):
    data_dir: str | None = None
    """GPT: where the shipped corpus, tokenizer and indexed dataset are prepared when missing;
    default $MEGAHET_DATA_DIR/gpt (~/.cache/megahet/gpt)."""
    data_path: str | None = None
    """GPT: prefix of an existing indexed dataset (<prefix>.bin/.idx); skips preparation."""
    tokenizer_model: str | None = None
    """GPT: an existing sentencepiece model, or a Hugging Face tokenizer.json (or its folder); required with
    data_path."""
    vocab_size: int = 8192
    """GPT: vocabulary of the tokenizer trained when the data is prepared."""
    split: str = "90,5,5"
    """GPT: train,valid,test weights over documents."""
    packing: Literal["none", "documents"] = "none"
    """GPT: none = fixed-length chunks of concatenated text (attention crosses documents); documents = whole
    documents packed into micro-batches of up to data.max_tokens tokens, attention inside each document,
    positions restarting per document, planned over replicas by cost and speed (docs/packing.md)."""
    max_tokens: int | None = None
    """GPT, packing: tokens per packed micro-batch (longer documents are cut into pieces); default model.seq_length."""
    replica_max_tokens: str | None = None
    """GPT, packing: a token cap per DP replica, comma-separated (e.g. 4096,2048 for a replica of GPUs with
    less memory); documents longer than a replica's cap go to one that holds them. Default data.max_tokens."""
    length_mix: Literal["documents", "web", "code", "long"] = "documents"
    """GPT, packing: the corpus's own documents, or its text re-cut at web-like, code-like or long-context
    lengths (log-normal body, Pareto tail; long: most around 256 tokens, one in 16 from a tail reaching
    16-32x that, for context parallelism)."""
    packing_strategy: Literal["cost", "tokens", "round_robin"] = "cost"
    """GPT, packing: cost = by predicted cost and replica speed (Hydraulis-style); tokens = Karmarkar-Karp on
    token counts (verl); round_robin = documents dealt in order (no balancing)."""
    packing_tries: int = 16
    """GPT, packing: random document orders the replica assignment tries after longest-first."""
    cost_window: int = 64
    """GPT, packing: measured (replica, step) samples the document cost model is refitted on."""
    doc_cost: str | None = None
    """GPT, packing: a fixed cost model 'A,B,C' (seconds per token^2, per token, per micro-batch); None
    profiles it at start-up and refines it from measured step times."""


@dataclasses.dataclass(kw_only=True)
class LoggingConfig(_Section):
    wandb: bool = True
    wandb_project: str = "megahet"
    wandb_run_name: str | None = None
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    tensorboard_dir: str | None = None
    metrics_file: str | None = None
    """Append every logged record as one JSON line ({"step": ..., metric: value}) to this file."""
    log_dir: str = "runs"
    """wandb and tensorboard files go under <log_dir>/<run name>."""


@dataclasses.dataclass(kw_only=True)
class ResizeConfig(_Section):
    """ZERO-resizing: slow ranks drop a fraction gamma of their work units (see README)."""

    enabled: bool = False
    """Build the models with megahet's resizable TP layers; implied by `gamma`."""
    gamma: str | None = None
    """Static resizing: 'TP:GAMMA' for every DP replica of a TP rank, or 'DP.TP:GAMMA', comma-separated."""
    migrate: str | None = None
    """Lossless migration: 'TP:FRACTION[@H1+H2]' moves that fraction of a TP rank's units (every block)
    to helpers of its TP group (default all others); 'DP.TP:...' for one DP replica. Needs ZeRO-1."""
    block_gamma: str | None = None
    """Per-block overrides for resized ranks: 'mlp:LAYER=GAMMA,attn:LAYER=GAMMA' (global 1-based layers)."""
    unit_multiple: int | None = None
    """A resized MLP keeps, and a migrated MLP chunk moves, a multiple of this many units: GPU GEMMs fall off
    the tensor-core path at widths that are not multiples of 8 (64 is faster still; examples/gpu set it).
    None: 8 on CUDA, 1 (no rounding) on CPU."""
    imputation: Literal["zero", "same", "average"] = "zero"
    """Gradient of units no replica computed: zero (frozen), same (last measured), average (mean of kept)."""
    selection: Literal["random", "priority"] = "priority"
    """Which units to drop: random (seeded) or priority (lowest `priority_score` first)."""
    priority_score: Literal["variance", "snr", "signal", "taylor"] = "variance"
    """Priority of a unit from its gradient statistics: variance over steps, snr (steady share of the
    gradient, what Adam's update size follows), signal (norm of the mean gradient) or taylor (squared
    first-order loss change of removing the unit, (g . w)^2); see megahet/policy/selection.py."""
    priority_temperature: float = 1.0
    """0: drop the lowest scores; t > 0: sample the dropped units with probability proportional to
    score^(-1/t) (seeded: reproducible, the same on every rank); large t approaches random."""
    reselect_interval: int = 10
    """Steps between two selections of the dropped units."""
    max_drop_steps: int = 50
    """Fairness guard: a unit dropped this many consecutive steps is kept at the next selection."""
    score_decay: float = 0.9
    """EMA decay of the priority statistics (per-unit gradient mean and squared norm) per step."""
    score_interval: int = 5
    """The priority statistics sample one step in this many (steps 0, k, 2k, ...; each sample decays the
    EMA by score_decay^k, so it forgets at the same rate per step): the gradient sampling, its copies and
    the statistics' update are host and device work on every step they run, with nothing to balance too
    (issue 48). 1: every step."""
    score_samples: int = 1024
    """Gradient elements per unit the priority statistics follow (a fixed random sample, the same for
    every unit; 0 = all): memory and time of the statistics stay small at any model size."""

    @property
    def active(self) -> bool:
        return self.enabled or bool(self.gamma) or bool(self.migrate)


@dataclasses.dataclass(kw_only=True)
class DeviceConfig(_Section):
    """Virtual heterogeneous devices (emulated speeds; see megahet/runtime/devices.py)."""

    profile: str | None = None
    """Per-TP-rank speeds: static:S0,S1,..., schedule:STEP=S0,...;STEP=..., rotating:SLOWDOWN,PERIOD,
    contention:SLOWDOWN,PERIOD[,SEED], or a YAML/JSON file; static and schedule may instead list one speed
    per global rank (a slow replica or node). None: the real devices as they are."""
    collective_delay_ms: str | None = None
    """Per-TP-rank delay before every collective the rank joins, 'D0,D1,...' in milliseconds (one per TP rank,
    or one per global rank), on the virtual devices of device.profile: a time-sliced rank, late to each
    collective whatever its work (measured 1.5-2.4 ms on a shared CPU core: benchmarks/collective_delay.py).
    None: no delay."""
    rate_gflops: float = 20.0
    """Nominal speed of a virtual device (speed 1) in GFLOP/s; keep it below the real rank's speed (a
    step's real compute must fit in its charge, FLOPs / (rate x speed): `device_overrun_s` says when not)."""


@dataclasses.dataclass(kw_only=True)
class BalanceConfig(_Section):
    """The automatic balancer (see megahet/runtime/balancer.py and megahet/policy/planner.py)."""

    mode: Literal["static", "resize", "migrate", "semi"] = "static"
    """static: no balancing; resize: ZERO-resizing only; migrate: lossless migration only; semi: both."""
    interval: int = 1
    """Steps between two planning decisions."""
    window: int = 3
    """Speed samples per rank in the estimator's median (one outlier cannot move it; a real change
    is followed after window // 2 + 1 samples)."""
    tolerance: float = 0.3
    """semi: a straggler whose gap (1 - its ideal share) is below this resizes, else migrates."""
    healthy_gap: float = 0.05
    """The group is healthy (even split) when every rank is within this of the fastest."""
    hysteresis: float = 0.05
    """Keep the current plan unless some rank's work would change by more than this (of its units)."""
    whole_step: bool = False
    """Plan on each rank's whole step: the work it can move plus its measured fixed work (optimizer step,
    embedding, output layer, loss, data), which a slow device is slow at too. Off by default: fixed work
    in a synchronous phase of its own (the optimizer step) cannot be offset by moving work, and a plan
    that tries drops or moves units for nothing; under time-sliced contention it captured more of the
    possible gain (docs/balancer.md has both measurements). The TP, DP and pipeline balancers follow it."""
    trace: str | None = None
    """Write every step's per-rank busy time, estimated speed and plan to this JSONL file (one per
    pipeline stage: _stageP is added when PP > 1) and draw it as a PNG beside it at the end of the
    run (tools/plot_balance.py redraws it). Also measures (never plans) when mode=static."""
    replay: str | None = None
    """A --balance.trace file of an earlier run: execute its TP plans step by step instead of planning
    from measurements (the same command and seed then give the recorded run's losses bit for bit, so a
    loss spike of a lossy run can be reproduced and debugged). balance.mode must be the recorded run's."""

    @property
    def active(self) -> bool:
        """The balancer runs: it plans (mode != static) or only measures (a trace is asked for)."""
        return self.mode != "static" or bool(self.trace)

    @property
    def plans(self) -> bool:
        """The TP balancer changes the plan (any mode but static)."""
        return self.mode != "static"

    @property
    def resizes(self) -> bool:
        """The mode may drop units (ZERO-resizing): resize, semi."""
        return self.mode in ("resize", "semi")

    @property
    def migrates(self) -> bool:
        """The mode may move units to other ranks (lossless migration): migrate, semi."""
        return self.mode in ("migrate", "semi")


@dataclasses.dataclass(kw_only=True)
class HeteroConfig(_Section):
    """Heterogeneous data parallelism: replicas get shares of every global batch by speed
    (docs/balancer.md; megahet/runtime/dp_balancer.py and megahet/policy/dp_shares.py)."""

    speeds: str | None = None
    """Declared relative speeds per global rank, 'S0,S1,...' (one per rank), or a YAML/JSON file with
    `ranks: [S0, ...]` / `ranks: {RANK: S}` or `nodes: {NODE: S}` (node i = ranks i*L..i*L+L-1, L ranks
    per node; unnamed ranks and nodes are 1). They set the data-parallel shares and the TP plan from step 0."""
    dp_shares: Literal["even", "declared", "measured"] = "even"
    """even: M / DP micro-batches per replica; declared: fixed shares from hetero.speeds; measured: shares
    re-planned at run time from each replica's measured speed (starting from hetero.speeds if given)."""
    interval: int = 1
    """measured: steps between two share decisions."""
    window: int = 3
    """measured: speed samples per rank in the median (one outlier cannot move it)."""
    healthy_gap: float = 0.05
    """Replicas within this of the fastest split the batch evenly."""
    hysteresis: float = 0.05
    """measured: keep the current shares (or stage split) unless the new ones cut the slowest replica's
    (stage's) time by more than this fraction (noise and ties do not move samples or layers back and forth)."""
    pp_split: Literal["even", "declared", "measured"] = "even"
    """Heterogeneous pipeline stages: even (parallel.stage_layers, or L / PP each); declared: layers per stage
    from hetero.speeds at start; measured: re-split at run time from each stage's measured time per layer
    (starting from hetero.speeds or parallel.stage_layers), moving layers with their optimizer state."""
    pp_patience: int = 3
    """measured: planning decisions in a row that must ask for the same new split before the stages are
    re-split (noise does not move layers)."""
    resplit_horizon: int = 100
    """measured: a re-split must pay within this many steps (or the steps left, if fewer): the modeled time
    it saves per step times them must exceed its cost, measured by the last re-split (before one, the
    stages' build time at start). The decision is printed."""

    @property
    def active(self) -> bool:
        """Data-parallel shares are planned (declared or measured)."""
        return self.dp_shares != "even"

    @property
    def pp_active(self) -> bool:
        """The pipeline split is planned (declared or measured)."""
        return self.pp_split != "even"


@dataclasses.dataclass(kw_only=True)
class EscalateConfig(_Section):
    """Escalation (docs/balancer.md; megahet/runtime/escalation.py): when balancing inside the layout cannot
    win (a time-sliced rank, late to every collective of its TP group), move to another TP x DP layout in
    place, and back when the straggler is gone, each when it pays."""

    mode: Literal["off", "on"] = "off"
    """on: measure every step, print every decision, and move when the escalation ladder says so."""
    patience: int = 1
    """Steps in a row a straggler must at least be flagged before a move (and gone before the way back). A
    move also waits until staying has lost as much time as the move costs (break-even): a large saving moves
    at once, a marginal one later, a short episode never."""
    horizon: int = 100
    """A move must pay within this many steps (or the steps left, if fewer): the predicted time it saves
    per step times them must exceed its cost (the last move's, measured; before one, a rehearsal's price)."""
    min_gain: float = 0.05
    """The other layout must save at least this fraction of the step."""
    delay_floor_ms: float = 0.5
    """A rank later than this to each collective (its peers' wait per collective minus its own) is a
    straggler, whatever its speed."""
    window: int = 3
    """Steps in the medians of the measurements (as balance.window and hetero.window)."""
    placement: bool = True
    """Place the ranks too: a TP x DP layout may take strided TP groups (megatron-core's order cp-ep-dp-tp-pp)
    where that puts late ranks in one group, one replica late instead of several."""
    memory_gib: float = 0.0
    """The memory a rank may hold on a moved-to layout; a layout predicted above it is left out. 0: the
    smallest GPU's, less plan.memory_reserve (no limit on CPU)."""

    @property
    def active(self) -> bool:
        return self.mode == "on"


@dataclasses.dataclass(kw_only=True)
class PlanConfig(_Section):
    """The layout planner (docs/planning.md): choose the layout for a described mixed cluster, then run it
    (`--plan auto --cluster cluster.yaml`; `tools/plan.py` prints and writes the plans instead)."""

    mode: Literal["off", "auto"] = "off"
    """auto: set parallel.tp, parallel.pp, parallel.zero_stage, parallel.stage_layers, train.micro_batch_size
    and the DP shares (hetero.speeds, declared) to the fastest plan for plan.cluster that fits in memory,
    with the nodes in the order the cluster file lists them (the order they were launched in)."""
    cluster: str | None = None
    """The cluster description, a YAML file: nodes with their GPU kind, count, memory, rate and links."""
    micro_batches: str = "1,2,4,8"
    """Micro-batch sizes the planner may choose from (those that divide train.global_batch_size)."""
    memory_reserve: float = 0.1
    """Fraction of each GPU's memory the plan leaves free (CUDA context, allocator fragmentation)."""
    efficiency: float = 1.0
    """Fraction of each node's tflops the matmuls reach (1: the cluster file gives effective rates)."""
    profile: str | None = None
    """A profiling run's `--balance.trace` file (this model on one node, PP 1, TP 2): calibrates the cost model with
    the layers' measured rate (in place of plan.efficiency), the compute outside them and the per-step
    time (docs/planning.md). Several files, comma-separated (one layout, a micro-batch size each), give
    the layers' rate per micro-batch size."""
    profile_node: int = 0
    """The position in the cluster file of the node whose GPUs ran the profile."""

    @property
    def auto(self) -> bool:
        return self.mode == "auto"


@dataclasses.dataclass(kw_only=True)
class MegahetConfig(_Section):
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    resize: ResizeConfig = dataclasses.field(default_factory=ResizeConfig)
    device: DeviceConfig = dataclasses.field(default_factory=DeviceConfig)
    balance: BalanceConfig = dataclasses.field(default_factory=BalanceConfig)
    hetero: HeteroConfig = dataclasses.field(default_factory=HeteroConfig)
    plan: PlanConfig = dataclasses.field(default_factory=PlanConfig)
    escalate: EscalateConfig = dataclasses.field(default_factory=EscalateConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def freeze(self) -> MegahetConfig:
        """Refuse every later assignment to this configuration and its sections; returns it."""
        for f in dataclasses.fields(self):
            object.__setattr__(getattr(self, f.name), "_frozen", True)
        object.__setattr__(self, "_frozen", True)
        return self

    @property
    def frozen(self) -> bool:
        return self._frozen


SECTIONS = {f.name: f.type for f in dataclasses.fields(MegahetConfig)}
