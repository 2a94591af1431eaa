"""The model zoo: small, real architectures built from Hugging Face ``transformers`` configs.

The zoo is a conformance matrix. Every :class:`ZooCase` builds a tiny model with random weights
(nothing is downloaded) in ``train()`` mode with dropout, stochastic depth and BatchNorm live,
and gives one small call's worth of inputs. For every case and every fxckpt strategy (``every``,
``depth``, ``budget``, offload, stages, ...), a training step through the transformed module must
produce the same bits as the unmodified model run with the same seed: the same outputs, every
parameter's gradient and every buffer (BatchNorm statistics, counters) ``torch.equal`` to eager.
The cases cover the shapes of model users bring: CNNs with BatchNorm and squeeze-excitation,
plain and windowed vision transformers, decoder LMs (GQA, RoPE, sliding windows, soft-capping,
tied and untied embeddings), mixture-of-experts routing, encoders, encoder-decoders whose loss
comes out of the model, speech models fed raw audio or features, a two-tower vision-language
model, and a PEFT-style model whose base is frozen and whose inputs need no grad. ``depth`` names
a module nesting depth (``model.layers.0`` is depth 3) whose modules are the repeated blocks,
for the ``depth=`` strategy; ``note`` records what is special about a case (a custom
``autograd.Function``, a shared layer, a loss computed inside the model, ...).

Factories seed torch themselves (``torch.manual_seed(0)``), so two ``make()`` calls give the same
weights; ``inputs()`` draws from torch's RNG, so seed before calling it for identical inputs.
``HAZARDS`` holds cases no graph-capturing tool can match bit for bit (numpy randomness inside the
forward, a data-dependent Python branch): a tool must refuse them with a clear error or fall back,
never silently train to other bits. ``KNOWN_EXPORT_ISSUES`` says where plain ``torch.export`` (the
capture fxckpt falls back to, since ``symbolic_trace`` fails on every Hugging Face model here) is
not faithful to eager on its own.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn as nn

__all__ = ["ZooCase", "ZOO", "HAZARDS", "KNOWN_EXPORT_ISSUES", "LoRALinear", "by_name"]

ATTN = "eager"
"""Attention implementation every config is built with. "eager" is the only one every model here
accepts: "sdpa" raises ValueError at construction for the CNNs, Swinv2, Gemma2, GPT-J, GPT-Neo,
Bloom and DeBERTa-v2, and where it is accepted BEiT's exported gradients stop being bit-exact."""

P = 0.1
"""Dropout probability used for every hidden / attention / embedding dropout a config exposes."""

VOCAB = 96
BATCH = 2
SEQ = 12


@dataclasses.dataclass(frozen=True)
class ZooCase:
    """One architecture: how to build it, how to call it, where its repeated blocks are."""

    name: str
    """Short id, e.g. ``llama_gqa_rope``."""
    family: str
    """vision-cnn, vision-transformer, decoder-lm, moe-lm, encoder, encoder-decoder, speech,
    vision-language or lora."""
    make: Callable[[], nn.Module]
    """Builds the model in ``train()`` mode; seeds torch itself, so every call gives the same
    weights."""
    inputs: Callable[[], tuple[tuple, dict]]
    """``(args, kwargs)`` for one call; draws from torch's RNG (seed first for identical
    inputs)."""
    depth: int
    """A module nesting depth (dots + 1 in the path) whose modules are the repeated blocks."""
    note: str = ""
    """What is special: where the loss comes from, custom autograd Functions, hooks, shared
    layers..."""


# ---------------------------------------------------------------------------------------------
# Helpers


def _build(
    model_cls_name: str,
    config_cls_name: str,
    post: Callable[[nn.Module], None] | None = None,
    **config: object,
) -> Callable[[], nn.Module]:
    """A factory: ``transformers.<model_cls>(transformers.<config_cls>(**config))``, seeded,
    train().

    ``post`` runs on the built model (still under the same seed), e.g. to fix an initialisation."""

    def make() -> nn.Module:
        import transformers

        torch.manual_seed(0)
        cfg_cls = getattr(transformers, config_cls_name)
        cfg = cfg_cls(attn_implementation=ATTN, **config)
        model = getattr(transformers, model_cls_name)(cfg)
        if post is not None:
            post(model)
        return model.train()

    make.__name__ = f"make_{model_cls_name}"
    return make


def _lm(cls: str, cfg: str, **config: object) -> Callable[[], nn.Module]:
    """A decoder LM with the zoo's common sizes; ``config`` overrides them."""
    base: dict = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=64, use_cache=False,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(config)
    return _build(cls, cfg, **base)


def _ids(labels: bool = False, mask: bool = False, token_type: bool = False,
         seq: int = SEQ) -> Callable[[], tuple[tuple, dict]]:
    """Token ids ``(BATCH, seq)``, optionally an attention mask (last 3 tokens of row 1 padded),
    token type ids and ``labels`` (the ids, -100 on padding) so the model computes its loss."""

    def inputs() -> tuple[tuple, dict]:
        ids = torch.randint(3, VOCAB, (BATCH, seq))
        kw: dict = {}
        if mask:
            am = torch.ones(BATCH, seq, dtype=torch.long)
            am[1, -3:] = 0
            kw["attention_mask"] = am
        if token_type:
            tt = torch.zeros(BATCH, seq, dtype=torch.long)
            tt[:, seq // 2:] = 1
            kw["token_type_ids"] = tt
        if labels:
            lab = ids.clone()
            if mask:
                lab[kw["attention_mask"] == 0] = -100
            kw["labels"] = lab
        return (ids,), kw

    return inputs


def _class_labels(n: int) -> torch.Tensor:
    return torch.randint(0, n, (BATCH,))


def _cls_inputs() -> tuple[tuple, dict]:
    """Token ids with a padded attention mask and one class label per row (sequence
    classification)."""
    args, kw = _ids(mask=True)()
    kw["labels"] = _class_labels(3)
    return args, kw


def _electra_inputs() -> tuple[tuple, dict]:
    """Token ids, a padded attention mask and 0/1 "was this token replaced" labels per token."""
    args, kw = _ids(mask=True)()
    kw["labels"] = torch.randint(0, 2, (BATCH, SEQ))
    return args, kw


def _images(size: int = 32, labels: int = 0) -> Callable[[], tuple[tuple, dict]]:
    """``pixel_values`` ``(BATCH, 3, size, size)``, optionally class ``labels`` in
    ``[0, labels)``."""

    def inputs() -> tuple[tuple, dict]:
        x = torch.randn(BATCH, 3, size, size)
        if labels:
            return (x,), {"labels": _class_labels(labels)}
        return (x,), {}

    return inputs


# ---------------------------------------------------------------------------------------------
# Vision CNNs

_CNN_LABELS = 5

resnet = _build(
    "ResNetForImageClassification",
    "ResNetConfig",
    embedding_size=16,
    hidden_sizes=[16, 32],
    depths=[2, 2],
    layer_type="basic",
    num_labels=_CNN_LABELS,
)

mobilenet_v2 = _build(
    "MobileNetV2ForImageClassification",
    "MobileNetV2Config",
    depth_multiplier=0.35,
    image_size=32,
    classifier_dropout_prob=P,
    num_labels=_CNN_LABELS,
)


def _unit_batchnorm(model: nn.Module) -> None:
    """EfficientNet initialises BatchNorm weights like Linear ones (normal, std 0.02): with that,
    the signal shrinks ~50x per block and the logits come out ~1e-23. Start every BatchNorm at
    weight 1."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.fill_(1.0)


efficientnet = _build(
    "EfficientNetForImageClassification",
    "EfficientNetConfig",
    post=_unit_batchnorm,
    image_size=32,
    width_coefficient=0.25,
    depth_coefficient=0.5,
    hidden_dim=320,
    in_channels=[32, 16, 24, 40],
    out_channels=[16, 24, 40, 80],
    kernel_sizes=[3, 3, 5, 3],
    strides=[1, 2, 2, 2],
    num_block_repeats=[1, 2, 2, 2],
    expand_ratios=[1, 6, 6, 6],
    depthwise_padding=[],
    dropout_rate=P,
    drop_connect_rate=0.2,
    num_labels=_CNN_LABELS,
)

regnet_y = _build(
    "RegNetForImageClassification",
    "RegNetConfig",
    embedding_size=16,
    hidden_sizes=[16, 32],
    depths=[2, 2],
    groups_width=8,
    layer_type="y",
    num_labels=_CNN_LABELS,
)

convnext = _build(
    "ConvNextForImageClassification",
    "ConvNextConfig",
    num_stages=2,
    hidden_sizes=[16, 32],
    depths=[2, 2],
    layer_scale_init_value=0.1,
    drop_path_rate=0.2,
    image_size=32,
    num_labels=_CNN_LABELS,
)

convnextv2 = _build("ConvNextV2Model", "ConvNextV2Config", num_stages=2, hidden_sizes=[16, 32],
                    depths=[2, 2], drop_path_rate=0.2, image_size=32)


# ---------------------------------------------------------------------------------------------
# Vision transformers

_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            hidden_dropout_prob=P, attention_probs_dropout_prob=P, image_size=32, patch_size=8)

vit = _build("ViTForImageClassification", "ViTConfig", num_labels=_CNN_LABELS, **_VIT)
deit = _build(
    "DeiTForImageClassificationWithTeacher", "DeiTConfig", num_labels=_CNN_LABELS, **_VIT
)
beit = _build(
    "BeitForImageClassification",
    "BeitConfig",
    use_relative_position_bias=True,
    layer_scale_init_value=0.1,
    drop_path_rate=0.2,
    use_mean_pooling=True,
    num_labels=_CNN_LABELS,
    **_VIT,
)
dinov2 = _build(
    "Dinov2Model",
    "Dinov2Config",
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    mlp_ratio=2,
    hidden_dropout_prob=P,
    attention_probs_dropout_prob=P,
    image_size=32,
    patch_size=8,
    layerscale_value=0.1,
    drop_path_rate=0.2,
)

_SWIN = dict(
    image_size=32,
    patch_size=2,
    embed_dim=16,
    depths=[2, 2],
    num_heads=[2, 4],
    window_size=4,
    mlp_ratio=2.0,
    hidden_dropout_prob=P,
    attention_probs_dropout_prob=P,
    drop_path_rate=0.2,
)

swin = _build("SwinForImageClassification", "SwinConfig", num_labels=_CNN_LABELS, **_SWIN)
swinv2 = _build("Swinv2Model", "Swinv2Config", **_SWIN)


# ---------------------------------------------------------------------------------------------
# Decoder LMs

llama = _lm("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2, attention_dropout=P,
            tie_word_embeddings=False)
mistral = _lm("MistralForCausalLM", "MistralConfig", num_key_value_heads=2, sliding_window=8,
              attention_dropout=P, tie_word_embeddings=False)
qwen2 = _lm("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2, attention_dropout=P,
            tie_word_embeddings=True)
gemma = _lm(
    "GemmaForCausalLM",
    "GemmaConfig",
    num_key_value_heads=1,
    head_dim=8,
    attention_dropout=P,
    tie_word_embeddings=True,
)
gemma2 = _lm(
    "Gemma2ForCausalLM",
    "Gemma2Config",
    num_key_value_heads=2,
    head_dim=8,
    query_pre_attn_scalar=8,
    sliding_window=8,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    attention_dropout=P,
    tie_word_embeddings=True,
)
phi = _lm(
    "PhiForCausalLM",
    "PhiConfig",
    resid_pdrop=P,
    embd_pdrop=P,
    attention_dropout=P,
    qk_layernorm=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    tie_word_embeddings=False,
)
phi3 = _lm("Phi3ForCausalLM", "Phi3Config", num_key_value_heads=2, resid_pdrop=P, embd_pdrop=P,
           attention_dropout=P, original_max_position_embeddings=64, tie_word_embeddings=False)
olmo = _lm(
    "OlmoForCausalLM", "OlmoConfig", clip_qkv=8.0, attention_dropout=P, tie_word_embeddings=True
)
stablelm = _lm(
    "StableLmForCausalLM",
    "StableLmConfig",
    num_key_value_heads=4,
    use_qkv_bias=True,
    qk_layernorm=True,
    hidden_dropout=P,
    attention_dropout=P,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
gpt_neox = _lm(
    "GPTNeoXForCausalLM",
    "GPTNeoXConfig",
    hidden_dropout=P,
    attention_dropout=P,
    use_parallel_residual=True,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)

gpt2 = _build(
    "GPT2LMHeadModel",
    "GPT2Config",
    vocab_size=VOCAB,
    n_positions=64,
    n_embd=32,
    n_layer=2,
    n_head=4,
    resid_pdrop=P,
    embd_pdrop=P,
    attn_pdrop=P,
    use_cache=False,
    bos_token_id=1,
    eos_token_id=2,
)
gptj = _build(
    "GPTJForCausalLM",
    "GPTJConfig",
    vocab_size=VOCAB,
    n_positions=64,
    n_embd=32,
    n_layer=2,
    n_head=4,
    rotary_dim=4,
    n_inner=64,
    resid_pdrop=P,
    embd_pdrop=P,
    attn_pdrop=P,
    use_cache=False,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
gpt_neo = _build(
    "GPTNeoForCausalLM",
    "GPTNeoConfig",
    vocab_size=VOCAB,
    max_position_embeddings=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    intermediate_size=64,
    attention_types=[[["global", "local"], 1]],
    window_size=8,
    resid_dropout=P,
    embed_dropout=P,
    attention_dropout=P,
    use_cache=False,
    bos_token_id=1,
    eos_token_id=2,
)
opt = _build(
    "OPTForCausalLM",
    "OPTConfig",
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    ffn_dim=64,
    num_attention_heads=4,
    max_position_embeddings=64,
    word_embed_proj_dim=32,
    dropout=P,
    attention_dropout=P,
    layerdrop=0.0,
    use_cache=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
bloom = _build(
    "BloomForCausalLM",
    "BloomConfig",
    vocab_size=VOCAB,
    hidden_size=32,
    n_layer=2,
    n_head=4,
    hidden_dropout=P,
    attention_dropout=P,
    use_cache=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


# ---------------------------------------------------------------------------------------------
# Mixture of experts

mixtral = _lm(
    "MixtralForCausalLM",
    "MixtralConfig",
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    attention_dropout=P,
    router_jitter_noise=0.05,
    output_router_logits=True,
    experts_implementation="grouped_mm",
    tie_word_embeddings=False,
)
qwen2_moe = _lm(
    "Qwen2MoeForCausalLM",
    "Qwen2MoeConfig",
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    attention_dropout=P,
    output_router_logits=True,
    experts_implementation="grouped_mm",
    tie_word_embeddings=False,
)
olmoe = _lm(
    "OlmoeForCausalLM",
    "OlmoeConfig",
    num_experts=4,
    num_experts_per_tok=2,
    intermediate_size=32,
    attention_dropout=P,
    experts_implementation="grouped_mm",
    tie_word_embeddings=False,
)


# ---------------------------------------------------------------------------------------------
# Encoders

_ENC = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    hidden_dropout_prob=P,
    attention_probs_dropout_prob=P,
    max_position_embeddings=64,
    pad_token_id=0,
)

bert = _build("BertModel", "BertConfig", **_ENC)
roberta = _build("RobertaForMaskedLM", "RobertaConfig", **{**_ENC, "pad_token_id": 1})
distilbert = _build(
    "DistilBertForSequenceClassification",
    "DistilBertConfig",
    vocab_size=VOCAB,
    dim=32,
    n_layers=2,
    n_heads=4,
    hidden_dim=64,
    dropout=P,
    attention_dropout=P,
    seq_classif_dropout=P,
    max_position_embeddings=64,
    num_labels=3,
)
albert = _build("AlbertForMaskedLM", "AlbertConfig", embedding_size=16, **_ENC)
electra = _build("ElectraForPreTraining", "ElectraConfig", embedding_size=16, **_ENC)
deberta_v2 = _build(
    "DebertaV2Model",
    "DebertaV2Config",
    relative_attention=True,
    position_buckets=16,
    max_relative_positions=32,
    pos_att_type=["p2c", "c2p"],
    norm_rel_ebd="layer_norm",
    share_att_key=True,
    position_biased_input=False,
    **_ENC,
)


# ---------------------------------------------------------------------------------------------
# Encoder-decoders

t5 = _build(
    "T5ForConditionalGeneration",
    "T5Config",
    vocab_size=VOCAB,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    dropout_rate=P,
    feed_forward_proj="gated-gelu",
    use_cache=False,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)

_BART = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
    dropout=P,
    attention_dropout=P,
    activation_dropout=P,
    encoder_layerdrop=0.0,
    decoder_layerdrop=0.0,
    use_cache=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=2,
    forced_eos_token_id=2,
)

bart = _build("BartForConditionalGeneration", "BartConfig", **_BART)
marian = _build("MarianMTModel", "MarianConfig", **_BART)


def _seq2seq_inputs() -> tuple[tuple, dict]:
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    am = torch.ones(BATCH, SEQ, dtype=torch.long)
    am[1, -3:] = 0
    labels = torch.randint(3, VOCAB, (BATCH, 8))
    return (ids,), {"attention_mask": am, "labels": labels}


# ---------------------------------------------------------------------------------------------
# Speech

_W2V = dict(
    vocab_size=32,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    conv_dim=[16, 32],
    conv_stride=[5, 2],
    conv_kernel=[10, 3],
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=4,
    hidden_dropout=P,
    activation_dropout=P,
    attention_dropout=P,
    feat_proj_dropout=P,
    final_dropout=P,
    layerdrop=0.0,
    mask_time_prob=0.0,
    pad_token_id=0,
    ctc_loss_reduction="mean",
)

wav2vec2 = _build(
    "Wav2Vec2ForSequenceClassification",
    "Wav2Vec2Config",
    num_labels=3,
    classifier_proj_size=16,
    **_W2V,
)
wav2vec2_ctc = _build("Wav2Vec2ForCTC", "Wav2Vec2Config", **_W2V)
wav2vec2_specaugment = _build(
    "Wav2Vec2Model",
    "Wav2Vec2Config",
    **{**_W2V, "mask_time_prob": 0.3, "mask_time_length": 2, "mask_time_min_masks": 1},
)
hubert = _build(
    "HubertModel",
    "HubertConfig",
    **{**_W2V, "feat_extract_norm": "layer", "do_stable_layer_norm": True},
)
sew_d = _build(
    "SEWDModel",
    "SEWDConfig",
    squeeze_factor=2,
    position_buckets=16,
    max_position_embeddings=32,
    **{k: v for k, v in _W2V.items() if k not in ("feat_proj_dropout",)},
)

AUDIO = 1600


def _audio(labels: str = "") -> Callable[[], tuple[tuple, dict]]:
    """Raw audio ``input_values`` (BATCH, AUDIO); ``labels``: "" none, "ctc" token ids, "cls"
    classes."""

    def inputs() -> tuple[tuple, dict]:
        x = torch.randn(BATCH, AUDIO)
        if labels == "ctc":
            return (x,), {"labels": torch.randint(1, 32, (BATCH, 5))}
        if labels == "cls":
            return (x,), {"labels": _class_labels(3)}
        return (x,), {}

    return inputs


whisper = _build(
    "WhisperForConditionalGeneration",
    "WhisperConfig",
    vocab_size=VOCAB,
    num_mel_bins=16,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    d_model=32,
    max_source_positions=16,
    max_target_positions=32,
    dropout=P,
    attention_dropout=P,
    activation_dropout=P,
    encoder_layerdrop=0.0,
    decoder_layerdrop=0.0,
    use_cache=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=1,
    begin_suppress_tokens=None,
    suppress_tokens=None,
)


def _whisper_inputs() -> tuple[tuple, dict]:
    feats = torch.randn(BATCH, 16, 32)  # (batch, mel bins, 2 * max_source_positions)
    return (feats,), {"labels": torch.randint(3, VOCAB, (BATCH, 8))}


# ---------------------------------------------------------------------------------------------
# Vision-language (two towers)

def _two_tower(
    model_cls: str, cfg_cls: str, top: dict | None = None, **text_extra: object
) -> Callable[[], nn.Module]:
    """A two-tower text/image model (a config with ``text_config`` and ``vision_config``; ``top``
    goes to the outer config, ``text_extra`` to the text tower's)."""

    def make() -> nn.Module:
        import transformers

        torch.manual_seed(0)
        text = dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=SEQ,
            attention_dropout=P,
            **text_extra,
        )
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
            attention_dropout=P,
        )
        cfg = getattr(transformers, cfg_cls)(
            text_config=text, vision_config=vision, attn_implementation=ATTN, **(top or {})
        )
        return getattr(transformers, model_cls)(cfg).train()

    make.__name__ = f"make_{model_cls}"
    return make


clip = _two_tower(
    "CLIPModel",
    "CLIPConfig",
    top={"projection_dim": 16},
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=VOCAB - 1,
)
siglip = _two_tower(
    "SiglipModel", "SiglipConfig", pad_token_id=0, bos_token_id=1, eos_token_id=VOCAB - 1
)


def _text_image_inputs() -> tuple[tuple, dict]:
    """Text ids ending in the end-of-text token (CLIP pools there) and images, as kwargs, loss
    on."""
    ids = torch.randint(3, VOCAB - 1, (BATCH, SEQ))
    ids[:, -1] = VOCAB - 1
    return (), {
        "input_ids": ids,
        "pixel_values": torch.randn(BATCH, 3, 32, 32),
        "return_loss": True,
    }


# ---------------------------------------------------------------------------------------------
# LoRA (PEFT-style): frozen base, trainable low-rank adapters, inputs that need no grad


class LoRALinear(nn.Module):
    """``base(x) + B(A(dropout(x))) * alpha / r`` around a frozen ``nn.Linear``.

    ``B`` starts small and non-zero (PEFT starts it at zero) so that both adapters get a non-zero
    gradient in the first step and a conformance check compares something."""

    def __init__(
        self, base: nn.Linear, r: int = 4, alpha: float = 8.0, dropout: float = P
    ) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        self.lora_dropout = nn.Dropout(dropout)
        self.scaling = alpha / r
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.normal_(self.lora_B.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def lora_llama() -> nn.Module:
    """A small Llama with every base parameter frozen and LoRA on q_proj / v_proj of every
    layer."""
    model = llama()
    torch.manual_seed(1)
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_proj = LoRALinear(attn.q_proj)
        attn.v_proj = LoRALinear(attn.v_proj)
    return model.train()


# ---------------------------------------------------------------------------------------------
# The catalog

_DEC_NOTE = "use_cache=False; loss computed inside the model from labels"

ZOO: list[ZooCase] = [
    # vision CNNs
    ZooCase(
        "resnet_bn",
        "vision-cnn",
        resnet,
        _images(labels=_CNN_LABELS),
        6,
        "BatchNorm (running stats + num_batches_tracked buffers); loss from labels",
    ),
    ZooCase(
        "mobilenet_v2",
        "vision-cnn",
        mobilenet_v2,
        _images(labels=_CNN_LABELS),
        3,
        "inverted residuals, depthwise convs, BatchNorm, ReLU6, TF 'same' padding",
    ),
    ZooCase(
        "efficientnet_se",
        "vision-cnn",
        efficientnet,
        _images(labels=_CNN_LABELS),
        4,
        "squeeze-excitation, BatchNorm, drop_connect (nn.Dropout on the block output)",
    ),
    ZooCase(
        "regnet_y_se",
        "vision-cnn",
        regnet_y,
        _images(labels=_CNN_LABELS),
        6,
        "RegNetY: grouped convs + squeeze-excitation, BatchNorm",
    ),
    ZooCase(
        "convnext_layerscale_droppath",
        "vision-cnn",
        convnext,
        _images(labels=_CNN_LABELS),
        6,
        "layer scale + stochastic depth (drop_path_rate=0.2, torch.rand per sample)",
    ),
    ZooCase(
        "convnextv2_grn_droppath",
        "vision-cnn",
        convnextv2,
        _images(),
        5,
        "global response norm + stochastic depth; no labels, loss = sum of squares of outputs",
    ),
    # vision transformers
    ZooCase("vit", "vision-transformer", vit, _images(labels=_CNN_LABELS), 3, "loss from labels"),
    ZooCase(
        "deit_distilled",
        "vision-transformer",
        deit,
        _images(),
        3,
        "cls + distillation tokens, two heads",
    ),
    ZooCase(
        "beit_relpos_layerscale",
        "vision-transformer",
        beit,
        _images(labels=_CNN_LABELS),
        3,
        "relative position bias, layer scale, stochastic depth, mean pooling",
    ),
    ZooCase(
        "dinov2_layerscale",
        "vision-transformer",
        dinov2,
        _images(),
        3,
        "layer scale, stochastic depth, interpolated position embeddings; the trainable "
        "embeddings.mask_token is unused without bool_masked_pos, so its grad must stay None",
    ),
    ZooCase(
        "swin_windowed",
        "vision-transformer",
        swin,
        _images(labels=_CNN_LABELS),
        6,
        "shifted windows, patch merging, stochastic depth; blocks are "
        "swin.encoder.layers.N.blocks.M; fxckpt exports images with only the batch dynamic (every "
        "dim dynamic takes 1-2 min)",
    ),
    ZooCase(
        "swinv2_windowed",
        "vision-transformer",
        swinv2,
        _images(),
        5,
        "cosine attention with log-spaced continuous position bias, res-post-norm; no sdpa "
        "support",
    ),
    # decoder LMs
    ZooCase(
        "llama_gqa_rope",
        "decoder-lm",
        llama,
        _ids(labels=True, mask=True),
        3,
        "GQA (4 query / 2 kv heads), RoPE, untied embeddings, padded attention_mask; " + _DEC_NOTE,
    ),
    ZooCase(
        "mistral_sliding",
        "decoder-lm",
        mistral,
        _ids(labels=True),
        3,
        "sliding_window=8 < sequence length, GQA, untied; " + _DEC_NOTE,
    ),
    ZooCase(
        "qwen2_tied",
        "decoder-lm",
        qwen2,
        _ids(),
        3,
        "tied embeddings (lm_head.weight is embed_tokens.weight), qkv bias; no labels",
    ),
    ZooCase(
        "gemma_tied_mqa",
        "decoder-lm",
        gemma,
        _ids(labels=True),
        3,
        "multi-query (1 kv head), embeddings scaled by sqrt(hidden), tied; " + _DEC_NOTE,
    ),
    ZooCase(
        "gemma2_softcap",
        "decoder-lm",
        gemma2,
        _ids(labels=True, mask=True),
        3,
        "attention + final logit soft-capping, alternating sliding/global layers, tied; "
        + _DEC_NOTE,
    ),
    ZooCase(
        "phi_partial_rotary",
        "decoder-lm",
        phi,
        _ids(labels=True),
        3,
        "parallel attention/MLP, partial rotary, qk layernorm, embedding + residual dropout; "
        + _DEC_NOTE,
    ),
    ZooCase(
        "phi3_fused",
        "decoder-lm",
        phi3,
        _ids(),
        3,
        "fused qkv_proj and gate_up_proj, residual dropout; no labels",
    ),
    ZooCase(
        "olmo_nonparam_ln",
        "decoder-lm",
        olmo,
        _ids(labels=True),
        3,
        "non-parametric LayerNorm, clip_qkv clamps q/k/v, tied; " + _DEC_NOTE,
    ),
    ZooCase(
        "stablelm_qk_norm",
        "decoder-lm",
        stablelm,
        _ids(labels=True),
        3,
        "per-head qk layernorm, qkv bias, partial rotary 0.25, hidden dropout; " + _DEC_NOTE,
    ),
    ZooCase(
        "gpt_neox_parallel",
        "decoder-lm",
        gpt_neox,
        _ids(labels=True, mask=True),
        3,
        "parallel residual, fused qkv, rotary_pct 0.25; decoder child is `gpt_neox`; " + _DEC_NOTE,
    ),
    ZooCase(
        "gpt2",
        "decoder-lm",
        gpt2,
        _ids(labels=True),
        3,
        "Conv1D (transposed Linear) projections, tied; decoder child is `transformer`; "
        + _DEC_NOTE,
    ),
    ZooCase(
        "gptj",
        "decoder-lm",
        gptj,
        _ids(),
        3,
        "parallel attention/MLP, interleaved rotary on rotary_dim=4; untied; no labels",
    ),
    ZooCase(
        "gpt_neo_local",
        "decoder-lm",
        gpt_neo,
        _ids(labels=True),
        3,
        "alternating global / local (window 8) attention, tied; " + _DEC_NOTE,
    ),
    ZooCase(
        "opt",
        "decoder-lm",
        opt,
        _ids(labels=True, mask=True),
        4,
        "learned positions offset by 2 (computed from attention_mask), blocks at "
        "model.decoder.layers.N, tied; " + _DEC_NOTE,
    ),
    ZooCase(
        "bloom_alibi",
        "decoder-lm",
        bloom,
        _ids(labels=True, mask=True),
        3,
        "ALiBi; its GELU is a custom torch.autograd.Function (GeLUFunction, hand-written "
        "backward) in training: torch.export inlines the Function's forward and differentiates "
        "that instead, so export-captured gradients differ from eager in the last bits; "
        "tied; " + _DEC_NOTE,
    ),
    # mixture of experts
    ZooCase(
        "mixtral_moe",
        "moe-lm",
        mixtral,
        _ids(labels=True),
        3,
        "top-2 of 4 experts (experts_implementation='grouped_mm'), router jitter noise (torch "
        "uniform_ in the router), router aux loss added to the loss (output_router_logits=True, "
        "so the first forward installs output-capturing forward hooks on the "
        "layers); " + _DEC_NOTE,
    ),
    ZooCase(
        "qwen2_moe_shared",
        "moe-lm",
        qwen2_moe,
        _ids(labels=True),
        3,
        "top-2 of 4 experts + a sigmoid-gated shared expert, aux loss (first forward installs "
        "output-capturing hooks); " + _DEC_NOTE,
    ),
    ZooCase("olmoe", "moe-lm", olmoe, _ids(), 3, "top-2 of 4 experts, qk norm; no labels"),
    # encoders
    ZooCase(
        "bert",
        "encoder",
        bert,
        _ids(mask=True, token_type=True),
        3,
        "attention_mask with padding, token_type_ids, pooler; no labels",
    ),
    ZooCase(
        "roberta_mlm",
        "encoder",
        roberta,
        _ids(labels=True, mask=True),
        4,
        "position ids derived from input_ids != padding_idx; MLM loss from labels",
    ),
    ZooCase(
        "distilbert_cls",
        "encoder",
        distilbert,
        _cls_inputs,
        4,
        "no token types, sequence classification loss from labels",
    ),
    ZooCase(
        "albert_shared",
        "encoder",
        albert,
        _ids(labels=True, token_type=True),
        6,
        "ONE layer (albert_layer_groups.0.albert_layers.0) called num_hidden_layers times: the "
        "depth-6 module runs twice per forward; factorised embeddings; MLM loss",
    ),
    ZooCase(
        "electra_disc",
        "encoder",
        electra,
        _electra_inputs,
        4,
        "replaced-token discriminator head, embedding projection 16 -> 32; BCE loss from 0/1 "
        "labels",
    ),
    ZooCase(
        "deberta_v2_relpos",
        "encoder",
        deberta_v2,
        _ids(mask=True),
        3,
        "disentangled attention (c2p + p2c), log-bucket relative positions, shared keys",
    ),
    # encoder-decoders
    ZooCase(
        "t5",
        "encoder-decoder",
        t5,
        _seq2seq_inputs,
        3,
        "relative position buckets, gated-gelu, decoder_input_ids shifted from labels inside the "
        "model; blocks at encoder.block.N and decoder.block.N; loss from labels",
    ),
    ZooCase(
        "bart",
        "encoder-decoder",
        bart,
        _seq2seq_inputs,
        4,
        "blocks at model.encoder.layers.N / model.decoder.layers.N; tied; loss from labels",
    ),
    ZooCase(
        "marian",
        "encoder-decoder",
        marian,
        _seq2seq_inputs,
        4,
        "sinusoidal positions (a frozen embedding), scaled embeddings; loss from labels",
    ),
    # speech
    ZooCase(
        "wav2vec2",
        "speech",
        wav2vec2,
        _audio(labels="cls"),
        4,
        "raw audio input_values; conv feature extractor with GroupNorm, weight-normed positional "
        "conv (a parametrization); the feature encoder sets requires_grad=True on a view of the "
        "input inside forward; SpecAugment OFF (mask_time_prob=0.0); the first forward installs "
        "output-capturing hooks; classification loss from labels",
    ),
    ZooCase(
        "hubert_stable_ln",
        "speech",
        hubert,
        _audio(),
        3,
        "pre-LN (do_stable_layer_norm) with LayerNorm feature extractor; SpecAugment OFF",
    ),
    ZooCase(
        "sew_d",
        "speech",
        sew_d,
        _audio(),
        4,
        "DeBERTa-style attention built on custom torch.autograd.Functions that draw torch "
        "randomness (XDropout) and mask (XSoftmax); squeeze/upsample around the encoder; "
        "SpecAugment OFF. torch.export inlines XSoftmax, whose forward does masked_fill_ on the "
        "softmax output in place: the captured graph's backward raises 'modified by an inplace "
        "operation'",
    ),
    ZooCase(
        "whisper",
        "speech",
        whisper,
        _whisper_inputs,
        4,
        "input_features (batch, 16 mels, 32 frames: exactly 2 * max_source_positions), "
        "decoder_input_ids shifted from labels inside the model; loss from labels",
    ),
    # vision-language
    ZooCase(
        "clip",
        "vision-language",
        clip,
        _text_image_inputs,
        4,
        "two towers (text_model / vision_model), contrastive loss (return_loss=True); all inputs "
        "as kwargs; torch.arange(len(logits)) in the loss pins the batch size even in a dynamic "
        "export",
    ),
    ZooCase(
        "siglip",
        "vision-language",
        siglip,
        _text_image_inputs,
        4,
        "two towers, sigmoid contrastive loss with learned bias, attention-pooling head",
    ),
    # LoRA / PEFT
    ZooCase(
        "lora_llama",
        "lora",
        lora_llama,
        _ids(labels=True),
        3,
        "every base parameter frozen; trainable LoRA A/B on q_proj and v_proj; inputs are integer "
        "ids, so NO input requires grad: only adapter parameters receive gradients",
    ),
]

HAZARDS: list[ZooCase] = [
    ZooCase(
        "wav2vec2_specaugment",
        "speech",
        wav2vec2_specaugment,
        _audio(),
        3,
        "SpecAugment ON (mask_time_prob=0.3): the time mask is drawn with numpy.random inside "
        "forward (_compute_mask_indices), so two eager runs with the same torch seed differ, and "
        "torch.export bakes the mask drawn at capture time into the graph as a constant (static "
        "export: every later call reuses it; dynamic export fails inside numpy on a symbolic "
        "size)",
    ),
    ZooCase(
        "wav2vec2_ctc_labels",
        "speech",
        wav2vec2_ctc,
        _audio(labels="ctc"),
        4,
        "Wav2Vec2ForCTC with labels: forward validates `labels.max() >= vocab_size` in Python, a "
        "data-dependent branch that torch.export (and symbolic_trace) cannot capture; eager is "
        "deterministic, so a tool must either fall back or fail with a clear capture error",
    ),
]
"""Cases a tool cannot be expected to match bit for bit through graph capture: it must detect and
refuse them (or fall back to eager) with a clear error, never silently train to different bits."""


KNOWN_EXPORT_ISSUES: dict[str, str] = {
    "bloom_alibi": "export is not bit-exact: the custom autograd.Function's backward is replaced "
    "by autograd of its inlined forward (gradients differ by ~1e-8)",
    "sew_d": "export captures, but the exported graph's backward fails: XSoftmax's in-place "
    "masked_fill_ on a softmax output is no longer hidden inside a custom autograd.Function",
    "clip": "a dynamic-shape export specialises the batch size (torch.arange(len(logits))): "
    "another batch size needs another capture",
    "wav2vec2_specaugment": "numpy randomness: export bakes the capture-time mask into the graph "
    "as a constant",
    "wav2vec2_ctc_labels": "export fails: data-dependent Python branch on labels.max()",
}
"""What plain ``torch.export.export(model, args, kwargs, strict=False)`` + ``ep.module()`` does
wrong on these cases (torch 2.13, transformers 5.23). Every other case exports statically and with
every input dim ``Dim.AUTO`` and replays eager bit for bit (outputs, every grad, every buffer),
also at a second batch size / sequence length."""


def by_name(name: str) -> ZooCase:
    for case in ZOO + HAZARDS:
        if case.name == name:
            return case
    raise KeyError(name)
