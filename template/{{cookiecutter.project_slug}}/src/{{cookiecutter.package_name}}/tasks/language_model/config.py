"""The language model's recipe sections: `model:` (a decoder-only transformer of one family) and `data:` (tokens).

`LanguageModelRecipe` is the Recipe of `task: language_model`. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...recipe.bounds import bounds
from ...recipe.schema import EvalConfig, Recipe, field_path


@dataclass
class MoeConfig:
    """A mixture of experts in place of each block's MLP (llama only): a router sends each token to top_k of
    num_experts SwiGLU experts and sums their outputs, weighted by its scores (families/llama/moe.py).

    Args:
        num_experts: Routed experts per block; 0: a dense MLP (the other fields then stay at their defaults).
        top_k: Experts each token is sent to (at most num_experts).
        expert_intermediate_size: Hidden width of each expert's SwiGLU; 0: the dense MLP's
            (model.intermediate_size or Llama's rule).
        shared_experts: Experts every token passes through besides its routed ones (DeepSeek-MoE); 0: none.
        gate: How router logits become scores: softmax (over the experts: Mixtral, Qwen-MoE) or sigmoid
            (each expert on its own: DeepSeek-V3).
        normalize_top_k: Divide each token's top_k scores by their sum, so its expert weights add up to 1.
        load_balance: What keeps the experts' loads even: aux_loss (Switch/Mixtral: aux_loss_weight x
            num_experts x sum_i f_i P_i, f_i the share of routed tokens expert i got, P_i its mean router
            probability; 1.0 when the routing is uniform), bias (DeepSeek-V3, without an auxiliary loss: a
            per-expert bias added to the scores for the top_k choice only, moved by bias_update_rate towards
            the under-loaded experts after every optimizer step) or none.
        aux_loss_weight: Weight of the auxiliary loss in the loss backpropagated (load_balance=aux_loss).
        bias_update_rate: Step of the bias update, bias += rate x sign(mean load - load) (load_balance=bias).
        capacity_factor: Tokens an expert takes per micro-batch, as a multiple of an even share
            (tokens x top_k / num_experts); those beyond it are dropped (they skip that expert) and counted.
            null: dropless (every expert takes all it is sent).
    """

    num_experts: int = field(default=0, metadata=bounds(at_least=0, at_most=4096, note="0: a dense MLP"))
    top_k: int = field(default=2, metadata=bounds(at_least=1))
    expert_intermediate_size: int = field(default=0, metadata=bounds(at_least=0, note="0: the dense MLP's width"))
    shared_experts: int = field(default=0, metadata=bounds(at_least=0, note="0: none"))
    gate: Literal["softmax", "sigmoid"] = "softmax"
    normalize_top_k: bool = True
    load_balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    aux_loss_weight: float = field(default=0.01, metadata=bounds(at_least=0))
    bias_update_rate: float = field(default=0.001, metadata=bounds(at_least=0))
    capacity_factor: float | None = field(default=None, metadata=bounds(above=0, note="or null: dropless"))


@dataclass
class ModelConfig:
    """A decoder-only transformer; the defaults make a tiny model that trains on a laptop CPU.

    Args:
        arch: Model family: gpt (GPT-2-style: learned positions, LayerNorm, GELU MLP) or llama (rotary
            positions, RMSNorm, SwiGLU MLP, grouped-query attention, no biases). families/ lists them.
        vocab_size: Size of the token vocabulary (256 for the byte-level text data).
        block_size: Context length in tokens.
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block; must divide n_embd.
        n_embd: Width of the residual stream.
        mlp_ratio: Hidden width of the MLP as a multiple of n_embd (gpt only).
        dropout: Dropout probability (0 for pre-training; gpt only).
        bias: Whether linear and norm layers have a bias (gpt only).
        n_kv_head: Key/value heads for grouped-query attention; must divide n_head; 0 means n_head
            (ordinary multi-head attention). llama only.
        intermediate_size: Hidden width of the SwiGLU MLP; 0 applies Llama's rule (8/3 x n_embd
            rounded up to a multiple of 256). llama only.
        rope_theta: Base of the rotary position angles (10000 in Llama 2, 500000 in Llama 3). llama only.
        tie_embeddings: Share one matrix between the token embedding and the output head. llama only.
        norm_eps: Epsilon of the RMSNorm layers. llama only.
        init_from: A local Hugging Face Llama folder (a Mixtral one for a mixture of experts; config.json +
            safetensors) whose weights the run starts from instead of a random init; its config must match this
            section. llama only.
        moe: A mixture of experts in place of each block's MLP (MoeConfig); num_experts 0: dense. llama only.
    """

    arch: Literal["gpt", "llama"] = "gpt"
    vocab_size: int = field(default=256, metadata=bounds(at_least=1))
    block_size: int = field(default=128, metadata=bounds(at_least=1))
    n_layer: int = field(default=4, metadata=bounds(at_least=1))
    n_head: int = field(default=4, metadata=bounds(at_least=1))
    n_embd: int = field(default=128, metadata=bounds(at_least=1))
    mlp_ratio: int = field(default=4, metadata=bounds(at_least=1))
    dropout: float = field(default=0.0, metadata=bounds(at_least=0, below=1))
    bias: bool = False
    n_kv_head: int = field(default=0, metadata=bounds(at_least=0, note="0: n_head"))
    intermediate_size: int = field(default=0, metadata=bounds(at_least=0, note="0: Llama's rule"))
    rope_theta: float = field(default=10000.0, metadata=bounds(above=0))
    tie_embeddings: bool = False
    norm_eps: float = field(default=1e-5, metadata=bounds(above=0))
    init_from: str | None = None
    moe: MoeConfig = field(default_factory=MoeConfig)

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_head when n_kv_head is 0)."""
        return self.n_kv_head or self.n_head

    @property
    def mlp_hidden_size(self) -> int:
        """Hidden width of the MLP: gpt's mlp_ratio x n_embd; llama's intermediate_size or Llama's rule."""
        if self.arch == "gpt":
            return self.mlp_ratio * self.n_embd
        if self.intermediate_size:
            return self.intermediate_size
        return -(-int(8 * self.n_embd / 3) // 256) * 256

    @property
    def expert_hidden_size(self) -> int:
        """Hidden width of each expert's SwiGLU (moe.expert_intermediate_size, or the dense MLP's)."""
        return self.moe.expert_intermediate_size or self.mlp_hidden_size

    def tensor_parallel_dimensions(self) -> dict[str, int]:
        """Sizes that tensor parallel splits evenly over its ranks (attention heads and widths)."""
        dimensions = {"n_head": self.n_head, "n_embd": self.n_embd}
        if self.arch == "llama":  # a mixture of experts splits its shared experts only (the task names their width)
            dimensions |= {"n_kv_head": self.kv_heads}
            if not self.moe.num_experts:
                dimensions |= {"intermediate_size": self.mlp_hidden_size}
        return dimensions


# Fields of ModelConfig that only one model family reads; the task refuses them changed on another.
ARCH_ONLY_FIELDS = {
    "mlp_ratio": "gpt",
    "dropout": "gpt",
    "bias": "gpt",
    "n_kv_head": "llama",
    "intermediate_size": "llama",
    "rope_theta": "llama",
    "tie_embeddings": "llama",
    "norm_eps": "llama",
    "init_from": "llama",
}


@dataclass
class DataConfig:
    """Where the tokens come from.

    Args:
        source: embedded (a corpus made in code, offline, no download), text (a folder of .txt
            files, byte-level tokens), tokens (a flat binary file of token ids, read by memory map)
            or prepared (a folder written by `prepare`: token shards, tokenizer, manifest).
        path: The folder (text, prepared) or file (tokens); unused for embedded. A prepared folder may
            also be a URL (s3://bucket/corpus, gs://..., hf://datasets/..., any fsspec protocol whose
            package is installed; `pip install .[s3]` for S3): its shards are read through a node-local
            cache (cache_dir, cache_gb). Credentials and endpoints come from the environment and the
            protocol's usual files (for S3: AWS_* variables, ~/.aws), never from the recipe.
        token_dtype: Integer type of the token file (uint16 for vocabularies up to 65536); a
            prepared folder states its own.
        val_fraction: Fraction of the tokens held out, at the end, for validation; a prepared
            folder brings its own split (`prepare --val_fraction`).
        verify: What a run checks of a prepared folder before its first step: sizes (the manifest
            and every file's size: a stat per file, whatever the corpus's size) or full (also every
            byte against its SHA-256, on local rank 0 of each node: about a second per GB). `data
            verify PATH` does the full check once, with a progress bar. A remote folder's files are
            checked against their SHA-256 as they arrive, whatever this says.
        shuffle_blocks: The order of a prepared folder's windows (local or remote): the windows that
            start in one shard form a block; each epoch permutes the blocks, then the windows of each
            group of shuffle_blocks consecutive blocks among themselves. Larger mixes more; a remote
            corpus's cache must hold two groups (the one read and the one fetched ahead).
        cache_dir: Where a remote folder's shards are cached on each node (shared by its ranks); null:
            $TMPDIR/<project>-shards/<hash of the URL>.
        cache_gb: Size bound of that cache in GB; the least recently read shards go first. It must
            hold 2 x 2 x shuffle_blocks of the largest shard (a block may read the start of the next
            shard); the run refuses to start otherwise.
        format: stream (the tokens are one stream cut into windows of block_size; every token counts
            in the loss) or sft (supervised fine-tuning: chat examples, each kept whole in a sequence,
            the loss on the assistant replies only; source prepared, from `prepare --format sft`, or
            embedded, the demo conversations). data/sft.py.
        packing: sft only: several examples fill one sequence, each attending only to itself (true),
            or one example per sequence, padded (false). Either way the loss is the same.
        document_mask: stream only: each token attends only to the earlier tokens of its own document, its
            rotary positions counted from the document's start, as packed sft examples do (false: a window is one
            sequence, attending across the documents it holds). A document ends at the end-of-document token: a
            prepared folder's (its manifest's eos_id), a newline for the byte-level sources (embedded, text). The
            same mask path as packed sft, so it runs under context parallel; data.source=tokens names no such
            token and is refused.
    """

    source: Literal["embedded", "text", "tokens", "prepared"] = "embedded"
    path: str | None = None
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    val_fraction: float = field(default=0.1, metadata=bounds(above=0, below=1))
    verify: Literal["sizes", "full"] = "sizes"
    shuffle_blocks: int = field(default=8, metadata=bounds(at_least=1))
    cache_dir: str | None = None
    cache_gb: float = field(default=50.0, metadata=bounds(above=0))
    format: Literal["stream", "sft"] = "stream"
    packing: bool = True
    document_mask: bool = False


@dataclass
class LanguageModelEvalConfig(EvalConfig):
    """Periodic validation, and downstream tasks of lm-evaluation-harness (`pip install .[eval]`) during training.

    Args:
        every_steps: Validate every this many steps and at the end; 0 disables validation.
        batches: Micro-batches per device in one validation pass.
        tasks: lm-eval tasks to score the model on during training (their scores are logged as
            eval/<task>/<metric>); names of lm-eval's library whose data sets are in the local Hugging
            Face cache, or of YAML tasks under tasks_include_path. Empty: none.
        tasks_every_steps: Run the tasks every this many steps and at the end; 0: at validation's steps.
        tasks_include_path: A folder of lm-eval task YAML files (with local data files).
        tasks_allow_code: Let the tasks_include_path folder's YAML run its own Python (`!function`):
            only for a folder you trust. False: such a folder is refused.
        tasks_limit: Examples per task (a fraction of them below 1); null: all.
    """

    tasks: list[str] = field(default_factory=list)
    tasks_every_steps: int = field(default=0, metadata=bounds(at_least=0, note="0: at validation's steps"))
    tasks_include_path: str | None = None
    tasks_allow_code: bool = False
    tasks_limit: float | None = field(default=None, metadata=bounds(above=0, note="or null: every example"))


# The projections of a block that LoRA may adapt, by family: attention's and the MLP's linear layers.
LORA_TARGETS = {
    "gpt": ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj"),
    "llama": ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down"),
}


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA) on the model's projections: only they train, the rest of the model is frozen.

    Args:
        rank: Rank of each adapter (the inner width of B @ A); 0 turns LoRA off (every parameter trains).
        alpha: The adapters' output is scaled by alpha / rank.
        dropout: Dropout on an adapter's input (0: none).
        target_modules: The projections of a block that get an adapter, by their name in the block
            (LORA_TARGETS lists each family's); empty: all of them.
    """

    rank: int = field(default=0, metadata=bounds(at_least=0, note="0: no adapters"))
    alpha: int = field(default=16, metadata=bounds(above=0))
    dropout: float = field(default=0.0, metadata=bounds(at_least=0, below=1))
    target_modules: list[str] = field(default_factory=list)

    def targets(self, arch: str) -> list[str]:
        """The projections adapted in a model of family `arch`."""
        return list(self.target_modules) or list(LORA_TARGETS[arch])


@dataclass
class LanguageModelRecipe(Recipe):
    """A recipe of `task: language_model`: the machinery's sections plus this task's model and data."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: LanguageModelEvalConfig = field(default_factory=LanguageModelEvalConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


# How messages about the data folder name its field.
DATA_PATH = field_path(DataConfig, "path")
