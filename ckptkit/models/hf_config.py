"""Canonical models from Hugging Face configs (pure): one reading per family of look-alikes.

``spec_from_config(config)`` reads a ``config.json`` (as a dict) by its ``model_type``:

- the Llama family (``LLAMA_LIKE``): Llama 2/3, Mistral, Qwen2 (q, k, v biases), Qwen3 and
  OLMo2 (q/k norms), Gemma and Gemma2 (tied; Gemma2's norms around both sublayers), OLMo
  (no norm weights), Phi-3, and their mixtures of experts: Mixtral, Qwen2-MoE (a gated shared
  expert), Qwen3-MoE, DeepSeek-V3 (multi-head latent attention, its first layers dense);
- GPT-NeoX (biases, layer norms with biases);
- GPT-2 (learned positions, tied head).

A value the family needs that the config lacks or gets wrong is refused in one line naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import LayoutError
from .spec import Block, ModelSpec, Rule, Tensor

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "olmo2", "phi3",
              "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
# Model types whose head is tied to the embedding unless the config says otherwise.
TIED_BY_DEFAULT = ("gemma", "gemma2", "gpt2")


class Config:
    """A config's values, read with the family's name for errors."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.raw = config
        self.type = str(config.get("model_type"))

    def int(self, key: str | tuple[str, ...], default: int | None = None) -> int:
        """The integer under `key` (or the first of several names of one value that is there)."""
        keys = (key,) if isinstance(key, str) else key
        key = next((k for k in keys if self.raw.get(k) is not None), keys[0])
        value = self.raw.get(key)
        if value is None and default is not None:
            return default
        if value is None:
            raise LayoutError(f"config.json ({self.type}) lacks {key}, an integer the model needs")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise LayoutError(f"config.json ({self.type}): {key} must be a non-negative integer, not {value!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        return default if value is None else bool(value)


def _t(name: str, shape: tuple[int, ...], cut: str | None = None) -> Tensor:
    return Tensor(name, shape, cut)  # type: ignore[arg-type]


def _mlp(prefix: str, h: int, f: int, gated: bool = True, bias: bool = False) -> list[Tensor]:
    out = [_t(f"{prefix}gate.weight", (f, h), "column")] if gated else []
    out.append(_t(f"{prefix}up.weight", (f, h), "column"))
    if bias:
        out += [_t(f"{prefix}gate.bias", (f,), "column")] if gated else []
        out.append(_t(f"{prefix}up.bias", (f,), "column"))
    out.append(_t(f"{prefix}down.weight", (h, f), "row"))
    return out + ([_t(f"{prefix}down.bias", (h,))] if bias else [])


def _attention(c: Config, h: int, bias: tuple[bool, bool]) -> list[Tensor]:
    """q, k, v and o (`bias`: on q, k, v; on o), with q/k norms where the architecture has them."""
    heads = c.int("num_attention_heads")
    kv = c.int("num_key_value_heads", heads)
    hd = c.int("head_dim", h // heads) if heads else 0
    out = [_t("attn.q.weight", (heads * hd, h), "column"), _t("attn.k.weight", (kv * hd, h), "column"),
           _t("attn.v.weight", (kv * hd, h), "column")]
    if bias[0]:
        out += [_t(f"attn.{n}.bias", (rows,), "column") for n, rows in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd))]
    out.append(_t("attn.o.weight", (h, heads * hd), "row"))
    out += [_t("attn.o.bias", (h,))] if bias[1] else []
    if c.type in ("qwen3", "qwen3_moe"):  # per head, replicated
        out += [_t("attn.q_norm.weight", (hd,)), _t("attn.k_norm.weight", (hd,))]
    if c.type == "olmo2":  # over every head's q (and k) at once: replicated
        out += [_t("attn.q_norm.weight", (heads * hd,)), _t("attn.k_norm.weight", (kv * hd,))]
    return out


def _attention_bias(c: Config) -> tuple[bool, bool]:
    """Whether q, k, v and whether o have biases: never (Mistral, Mixtral, Phi-3), on q, k, v
    (Qwen2 always, Qwen2-MoE by ``qkv_bias``), else all four by ``attention_bias``."""
    if c.type in ("mistral", "mixtral", "phi3"):
        return False, False
    if c.type in ("qwen2", "qwen2_moe"):
        return c.type == "qwen2" or c.flag("qkv_bias", True), False
    bias = c.flag("attention_bias", False)
    return bias, bias


def _latent_attention(c: Config, h: int) -> list[Tensor]:
    """DeepSeek's multi-head latent attention: q through a low-rank projection (or directly),
    k and v from one compressed latent; the up-projections are cut per head over TP."""
    heads, rank = c.int("num_attention_heads"), c.int("kv_lora_rank")
    nope, rope, vd = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim"), c.int("v_head_dim")
    q_rank = c.raw.get("q_lora_rank")
    out = ([_t("attn.q.weight", (heads * (nope + rope), h), "column")] if q_rank is None else
           [_t("attn.q_a.weight", (c.int("q_lora_rank"), h)), _t("attn.q_a_norm.weight", (c.int("q_lora_rank"),)),
            _t("attn.q_b.weight", (heads * (nope + rope), c.int("q_lora_rank")), "column")])
    bias = c.flag("attention_bias", False)  # on q_a, kv_a and o
    out += [_t("attn.q_a.bias", (c.int("q_lora_rank"),))] if bias and q_rank is not None else []
    out += [_t("attn.kv_a.weight", (rank + rope, h)), *([_t("attn.kv_a.bias", (rank + rope,))] if bias else []),
            _t("attn.kv_a_norm.weight", (rank,)), _t("attn.kv_b.weight", (heads * (nope + vd), rank), "column"),
            _t("attn.o.weight", (h, heads * vd), "row")]
    return out + ([_t("attn.o.bias", (h,))] if bias else [])


def _norms(c: Config, h: int) -> list[Tensor]:
    """A layer's norm weights: before attention and the MLP (Llama); also on each output
    (Gemma2); only on the outputs (OLMo2); none (OLMo's norms have no weights)."""
    if c.type == "olmo":
        return []
    if c.type == "olmo2":
        return [_t("attn_out_norm.weight", (h,)), _t("mlp_out_norm.weight", (h,))]
    out = [_t("attn_norm.weight", (h,)), _t("mlp_norm.weight", (h,))]
    return out + ([_t("attn_out_norm.weight", (h,)), _t("mlp_out_norm.weight", (h,))] if c.type == "gemma2" else [])


def _moe_layers(c: Config, n: int) -> tuple[int, list[bool]]:
    """The experts of each MoE layer and which of the `n` layers are MoE, by the family's rule."""
    if c.type == "mixtral":
        return c.int(("num_local_experts", "num_experts")), [True] * n
    if c.type in ("qwen2_moe", "qwen3_moe"):
        experts, step = c.int(("num_experts", "num_local_experts")), max(c.int("decoder_sparse_step", 1), 1)
        dense = set(c.raw.get("mlp_only_layers") or [])
        return experts, [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n)]
    if c.type == "deepseek_v3":
        experts, first, freq = c.int(("n_routed_experts", "num_local_experts")), c.int("first_k_dense_replace", 0), max(c.int("moe_layer_freq", 1), 1)
        return experts, [experts > 0 and i >= first and i % freq == 0 for i in range(n)]
    return 0, [False] * n


def _moe(c: Config, h: int, experts: int) -> tuple[list[Tensor], tuple[Tensor, ...]]:
    """A mixture-of-experts MLP: the router (and shared expert) in the layer, one expert's tensors."""
    f = c.int("intermediate_size") if c.type == "mixtral" else c.int("moe_intermediate_size")
    layer = [_t("mlp.router.weight", (experts, h))]
    if c.type == "deepseek_v3":
        layer.append(_t("mlp.router.score_bias", (experts,)))
        shared = c.int("n_shared_experts", 0) * f
        layer += _mlp("mlp.shared.", h, shared) if shared else []
    if c.type == "qwen2_moe":
        shared = c.int("shared_expert_intermediate_size", 0)
        layer += [*_mlp("mlp.shared.", h, shared), _t("mlp.shared_gate.weight", (1, h))] if shared else []
    return layer, tuple(_mlp("", h, f))


def llama_like(config: Mapping[str, Any]) -> ModelSpec:
    """A decoder of the Llama family (see the module docstring for the members and their differences)."""
    c = Config(config)
    h, v, n = c.int("hidden_size"), c.int("vocab_size"), c.int("num_hidden_layers")
    heads = c.int("num_attention_heads")
    if not heads or h % heads and config.get("head_dim") is None:
        raise LayoutError(f"config.json ({c.type}): num_attention_heads {heads} does not divide hidden_size {h} and no head_dim is given")
    attention = _latent_attention(c, h) if c.type == "deepseek_v3" else _attention(c, h, _attention_bias(c))
    experts, sparse = _moe_layers(c, n)
    blocks = []
    for moe in sparse:
        if moe:
            mlp, expert = _moe(c, h, experts)
            blocks.append(Block(tuple([*_norms(c, h), *attention, *mlp]), experts, expert))
        else:
            mlp_bias = c.type == "llama" and c.flag("mlp_bias", False)
            blocks.append(Block(tuple([*_norms(c, h), *attention, *_mlp("mlp.", h, c.int("intermediate_size"), bias=mlp_bias)])))
    tied = c.flag("tie_word_embeddings", c.type in TIED_BY_DEFAULT)
    last = ([] if c.type == "olmo" else [_t("norm.weight", (h,))]) + ([] if tied else [_t("lm_head.weight", (v, h), "vocab")])
    kv = c.int("num_key_value_heads", heads) if c.type != "deepseek_v3" else heads
    rules = [Rule("tp", "attention heads", divides=heads), Rule("tp", "key/value heads", divides=kv)]
    return _spec(c, "llama", [_t("embed.weight", (v, h), "vocab")], blocks, last, tied, rules)


def gpt_neox(config: Mapping[str, Any]) -> ModelSpec:
    """GPT-NeoX: layer norms with biases, biased q, k, v, o and an ungated MLP with biases."""
    c = Config(config)
    h, v, n, heads = c.int("hidden_size"), c.int("vocab_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    if not heads or h % heads:
        raise LayoutError(f"config.json (gpt_neox): num_attention_heads {heads} does not divide hidden_size {h}")
    norms = [_t(f"{n_}.{p}", (h,)) for n_ in ("attn_norm", "mlp_norm") for p in ("weight", "bias")]
    bias = c.flag("attention_bias", True)
    attention = [_t(f"attn.{x}.weight", (h, h), "column") for x in "qkv"]
    attention += [_t(f"attn.{x}.bias", (h,), "column") for x in "qkv"] if bias else []
    attention += [_t("attn.o.weight", (h, h), "row"), *([_t("attn.o.bias", (h,))] if bias else [])]
    block = Block(tuple([*norms, *attention, *_mlp("mlp.", h, c.int("intermediate_size"), gated=False, bias=True)]))
    tied = c.flag("tie_word_embeddings", False)
    last = [_t("norm.weight", (h,)), _t("norm.bias", (h,))] + ([] if tied else [_t("lm_head.weight", (v, h), "vocab")])
    return _spec(c, "gpt-neox", [_t("embed.weight", (v, h), "vocab")], [block] * n, last, tied,
                 [Rule("tp", "attention heads", divides=heads)])


def gpt2(config: Mapping[str, Any]) -> ModelSpec:
    """GPT-2: learned positions, layer norms with biases, biases everywhere, a tied head."""
    c = Config(config)
    h, v, n, heads = c.int("n_embd"), c.int("vocab_size"), c.int("n_layer"), c.int("n_head")
    f = c.int("n_inner", 4 * h)
    if not heads or h % heads:
        raise LayoutError(f"config.json (gpt2): n_head {heads} does not divide n_embd {h}")
    norms = [_t(f"{n_}.{p}", (h,)) for n_ in ("attn_norm", "mlp_norm") for p in ("weight", "bias")]
    attention = [_t(f"attn.{x}.weight", (h, h), "column") for x in "qkv"] + [_t(f"attn.{x}.bias", (h,), "column") for x in "qkv"]
    attention += [_t("attn.o.weight", (h, h), "row"), _t("attn.o.bias", (h,))]
    block = Block(tuple([*norms, *attention, *_mlp("mlp.", h, f, gated=False, bias=True)]))
    first = [_t("embed.weight", (v, h), "vocab"), _t("pos_embed.weight", (c.int("n_positions"), h))]
    return _spec(c, "gpt2", first, [block] * n, [_t("norm.weight", (h,)), _t("norm.bias", (h,))], True,
                 [Rule("tp", "attention heads", divides=heads)])


def _spec(c: Config, family: str, first: list[Tensor], blocks: list[Block], last: list[Tensor], tied: bool,
          rules: list[Rule]) -> ModelSpec:
    if tied:
        rules.append(Rule("pp", "tied embeddings need the embedding and the head on one stage", at_most=1))
    return ModelSpec(c.type, family, tuple(first), tuple(blocks), tuple(last), tied, tuple(rules), dict(c.raw))


# model_type -> the family reading its config
READERS: dict[str, Callable[[Mapping[str, Any]], ModelSpec]] = {
    **{t: llama_like for t in LLAMA_LIKE}, "gpt_neox": gpt_neox, "gpt2": gpt2}


def spec_from_config(config: Mapping[str, Any]) -> ModelSpec:
    """Return the canonical model a Hugging Face ``config.json`` describes.

    Raises:
        LayoutError: a model type no family reads, or a config value the family needs that is
            missing or wrong (named).
    """
    read = READERS.get(str(config.get("model_type")))
    if read is None:
        raise LayoutError(f"config.json: model_type {config.get('model_type')!r} has no canonical model here "
                          f"(known: {', '.join(sorted(READERS))})")
    return read(config)
