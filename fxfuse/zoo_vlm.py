"""Vision-language models for the harness: tiny configs (random weights) with one image in a training
batch, ``VLMS[model_type]() -> (config, inputs)``, built with AutoModelForImageTextToText
(``fxfuse check qwen2_5_vl``; tests/test_vlm.py). Image tokens are masked out of the labels, as a
processor's collator does."""
from __future__ import annotations

import torch

TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, use_cache=False, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
IMAGE = 100  # the image placeholder token


def _pixels(*shape: int) -> torch.Tensor:
    """Random pixel values of this shape, the same draw in every builder (seed 2)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(2))


def _ids(n_image: int, start: int | None = None, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, T] ids: 2 text tokens, [start,] n_image placeholders, [end,] 5 text tokens; labels."""
    g = torch.Generator().manual_seed(1)
    parts = [torch.randint(3, 90, (2,), generator=g), torch.tensor([start] if start is not None else []).long(),
             torch.full((n_image,), IMAGE), torch.tensor([end] if end is not None else []).long(),
             torch.randint(3, 90, (5,), generator=g)]
    ids = torch.cat(parts)[None]
    labels = ids.clone()
    labels[ids == IMAGE] = -100
    return ids, labels


# Qwen2.5-VL's windowed vision tower at tiny scale (patch 4, merged 2 x 2; window attention, then a full
# block) and M-RoPE sections over a head of 8 (t, h, w: 2, 1, 1 rotary pairs)
_QWEN_VISION = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, spatial_merge_size=2,
                    temporal_patch_size=2, out_hidden_size=32, window_size=16, fullatt_block_indexes=[1])
_MROPE = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}


def qwen_vl(model_type: str):
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL (-MoE) / Qwen3.5 (-MoE) / GLM-4V (-MoE) / GLM-4.6V: a vision transformer
    with 2-D RoPE on unbatched [T, H, D] q / k, M-RoPE in the language model; one 8 x 8-patch image merged 2 x 2
    into 16 tokens. Qwen3.5's language model: a gated-delta-net linear attention layer (q / k L2 norms) then a
    full one; GLM-4V's tower: RMSNorm, SwiGLU, learned position embeddings on the image_size / patch_size grid
    (GLM-4.6V: GLM-4V's configs under another model type)."""
    from transformers import AutoConfig

    vision = dict(_QWEN_VISION)
    if model_type == "qwen2_vl":
        vision = dict(depth=2, embed_dim=16, hidden_size=32, mlp_ratio=2, num_heads=2, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2)
    rope = dict(_MROPE)
    text, tokens = dict(TEXT), dict(vision_start_token_id=102, vision_end_token_id=103)
    qwen3_5 = model_type in ("qwen3_5", "qwen3_5_moe")
    if model_type in ("qwen3_vl", "qwen3_vl_moe") or qwen3_5:  # learned position embeddings on a 4 x 4 grid
        vision = {k: v for k, v in vision.items() if k not in ("window_size", "fullatt_block_indexes")}
        vision |= dict(num_position_embeddings=16)
        vision |= {"deepstack_visual_indexes": [0]} if not qwen3_5 else {}  # DeepStack from block 0
        rope |= {"mrope_interleaved": True}
    if model_type == "qwen3_vl_moe":  # 4 experts in every layer
        text |= dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    if model_type == "glm4v_moe":  # 4 routed experts after one dense layer, one shared expert; its rotary
        # half of 16-wide heads takes the M-RoPE sections
        text |= dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                     n_shared_experts=1, head_dim=16)
    if model_type == "qwen3_5_moe":  # 4 experts and a shared one in every layer
        text |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    if qwen3_5:
        text |= dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                     linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
    if model_type in ("glm4v", "glm4v_moe", "glm46v"):
        vision = {k: v for k, v in vision.items() if k not in ("window_size", "fullatt_block_indexes")}
        vision |= dict(image_size=16)
        tokens = dict(image_start_token_id=102, image_end_token_id=103, video_start_token_id=104,
                      video_end_token_id=105)
    cfg = AutoConfig.for_model(model_type, text_config={**text, "rope_parameters": rope}, vision_config=vision,
                               image_token_id=IMAGE, video_token_id=101, **tokens)
    return cfg, _patch_grid_image()


def _patch_grid_image() -> dict:
    """One 8 x 8-patch image (4 x 4 pixels, 2 frames each), flattened as Qwen-VL's processor gives it,
    merged 2 x 2 into 16 tokens between a start (102) and an end (103) token."""
    t, h, w = 1, 8, 8
    ids, labels = _ids(h * w // 4, start=102, end=103)
    pixels = _pixels(t * h * w, 3 * 2 * 4 * 4)
    return {"input_ids": ids, "labels": labels, "pixel_values": pixels, "image_grid_thw": torch.tensor([[t, h, w]]),
            "mm_token_type_ids": (ids == IMAGE).long()}


def exaone4_5():
    """EXAONE 4.5: Qwen2.5-VL's windowed vision tower (with grouped kv heads) and an EXAONE 4 (sliding-window
    and global layers, M-RoPE)."""
    from transformers import AutoConfig

    text = {"model_type": "exaone4", **TEXT, "rope_parameters": dict(_MROPE), "sliding_window": 8}
    cfg = AutoConfig.for_model("exaone4_5", text_config=text, vision_config=_QWEN_VISION | {"num_key_value_heads": 2},
                               image_token_id=IMAGE,
                               video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
    return cfg, _patch_grid_image()


def lfm3_vl():
    """LFM3-VL: a vision tower of short-convolution and attention blocks (axial 2-D RoPE) on Qwen-VL-style
    patches, and an LFM3 language model (a short convolution, then attention)."""
    from transformers import AutoConfig

    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                  layer_types=["conv", "full_attention"])
    text = TEXT | {"layer_types": ["conv", "full_attention"]}  # its default at 2 layers has no attention
    cfg = AutoConfig.for_model("lfm3_vl", text_config=text, vision_config=vision, image_token_id=IMAGE,
                               video_token_id=101, vision_start_token_id=102, vision_end_token_id=103,
                               projector_hidden_size=32)
    return cfg, _patch_grid_image()


def _vision_tower(model_type: str) -> dict:
    return {"model_type": model_type, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "image_size": 16, "patch_size": 4}


def llava(model_type: str = "llava"):
    """LLaVA / VipLLaVA: a CLIP vision tower (no rotary, quick_gelu MLP) and a Llama; 16 image tokens.
    VipLLaVA's projector reads the last two tower layers, concatenated."""
    from transformers import AutoConfig

    layers = {"vision_feature_layer": -1} if model_type == "llava" else {"vision_feature_layers": [-2, -1]}
    cfg = AutoConfig.for_model(model_type, text_config={"model_type": "llama", **TEXT},
                               vision_config=_vision_tower("clip_vision_model") | {"projection_dim": 16},
                               image_token_index=IMAGE, **layers)
    ids, labels = _ids(16)
    return cfg, {"input_ids": ids, "labels": labels,
                 "pixel_values": _pixels(1, 3, 16, 16)}


def llava_next(model_type: str):
    """LLaVA-NeXT (CLIP, Llama) / LLaVA-OneVision (SigLIP, Qwen2): "anyres" tiling with one 16 x 16 tile
    grid, so the image is a base view and one tile, 2 x 16 patch tokens, plus an image_newline per row
    of the tile's 4 x 4 grid: 36 image tokens."""
    from transformers import AutoConfig

    text, tower = ({"model_type": "llama"}, _vision_tower("clip_vision_model") | {"projection_dim": 16}) if (
        model_type == "llava_next") else ({"model_type": "qwen2"}, _vision_tower("siglip_vision_model"))
    cfg = AutoConfig.for_model(model_type, text_config=text | TEXT, vision_config=tower, image_token_index=IMAGE,
                               vision_feature_layer=-1, image_grid_pinpoints=[[16, 16]])
    ids, labels = _ids(36)
    return cfg, {"input_ids": ids, "labels": labels, "image_sizes": torch.tensor([[16, 16]]),
                 "pixel_values": _pixels(1, 2, 3, 16, 16)}


def mllama():
    """Mllama (Llama 3.2 Vision): a tiled ViT (local then global layers, gated) whose features the Llama reads
    through a cross-attention layer (q / k RMSNorms, no rotary) next to a self-attention one; one 1-tile image,
    one image token."""
    from transformers import AutoConfig

    # vision_output_dim: hidden_size x (1 + 2 intermediate layers)
    vision = dict(hidden_size=16, num_hidden_layers=2, num_global_layers=1, attention_heads=2, intermediate_size=32,
                  vision_output_dim=48, image_size=16, patch_size=4, max_num_tiles=1,
                  intermediate_layers_indices=[0, 1], supported_aspect_ratios=[[1, 1]])
    text = {k: v for k, v in TEXT.items() if k != "head_dim"} | {"cross_attention_layers": [1]}
    cfg = AutoConfig.for_model("mllama", text_config=text, vision_config=vision, image_token_index=IMAGE)
    ids, labels = _ids(1)
    return cfg, {"input_ids": ids, "labels": labels,
                 "pixel_values": _pixels(1, 1, 1, 3, 16, 16),
                 "aspect_ratio_ids": torch.tensor([[1]]), "aspect_ratio_mask": torch.ones(1, 1, 1, dtype=torch.long),
                 "cross_attention_mask": torch.ones(1, ids.shape[1], 1, 1, dtype=torch.long)}


def gemma3():
    """Gemma 3: a SigLIP vision tower and Gemma 3's language model, whose image tokens attend to each
    other both ways (token_type_ids: a mask function transformers builds with torch.vmap)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("gemma3", text_config={"model_type": "gemma3_text", **TEXT, "sliding_window": 8},
                               vision_config=_vision_tower("siglip_vision_model"), mm_tokens_per_image=4,
                               image_token_index=IMAGE, boi_token_index=104, eoi_token_index=105)
    ids, labels = _ids(4, start=104, end=105)
    return cfg, {"input_ids": ids, "labels": labels, "token_type_ids": (ids == IMAGE).long(),
                 "pixel_values": _pixels(1, 3, 16, 16)}


def mistral3():
    """Mistral 3: a Pixtral vision tower (RMSNorm, 2-D RoPE, SwiGLU) and a Mistral; a 16 x 16 image in
    4 x 4 patches merged 2 x 2 into 4 tokens."""
    from transformers import AutoConfig

    vision = {k: v for k, v in _vision_tower("pixtral").items() if k != "num_hidden_layers"}
    cfg = AutoConfig.for_model("mistral3", text_config={"model_type": "mistral", **TEXT},
                               vision_config=vision | {"num_hidden_layers": 2, "head_dim": 8},
                               image_token_index=IMAGE, spatial_merge_size=2, vision_feature_layer=-1)
    ids, labels = _ids(4)
    return cfg, {"input_ids": ids, "labels": labels, "image_sizes": torch.tensor([[16, 16]]),
                 "pixel_values": _pixels(1, 3, 16, 16)}


def paligemma():
    """PaliGemma: SigLIP and a Gemma, the image and prompt a bidirectional prefix (token_type_ids)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("paligemma", text_config={"model_type": "gemma", **TEXT},
                               vision_config=_vision_tower("siglip_vision_model") | {"projection_dim": 32},
                               image_token_index=IMAGE, projection_dim=32, hidden_size=32)
    ids, labels = _ids(16)
    return cfg, {"input_ids": ids, "labels": labels, "token_type_ids": (ids == IMAGE).long(),
                 "pixel_values": _pixels(1, 3, 16, 16)}


def idefics(model_type: str):
    """SmolVLM and Idefics 3 (its ancestor): a SigLIP-style tower, pixel shuffle by 2, and a Llama; one
    16 x 16 image, 4 tokens (Idefics 3's image splitting reads sizes on the host: graph breaks)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, text_config={"model_type": "llama", **TEXT},
                               vision_config=_vision_tower(f"{model_type}_vision"), image_token_id=IMAGE,
                               scale_factor=2)
    ids, labels = _ids(4)
    return cfg, {"input_ids": ids, "labels": labels,
                 "pixel_values": _pixels(1, 1, 3, 16, 16)}


def llama4():
    """Llama 4: a vision encoder with 2-D complex RoPE and a pixel-shuffle adapter (which reads its
    input width from the tower's intermediate_size), and Llama 4's MoE text model; 4 image tokens."""
    from transformers import AutoConfig

    text = {**TEXT, "model_type": "llama4_text", "intermediate_size_mlp": 48, "num_local_experts": 2,
            "interleave_moe_layer_step": 1, "attention_chunk_size": 64, "no_rope_layers": [1, 1]}
    vision = _vision_tower("llama4_vision_model") | {"intermediate_size": 64, "vision_output_dim": 32,
                                                     "projector_input_dim": 32, "projector_output_dim": 32,
                                                     "pixel_shuffle_ratio": 0.5}
    cfg = AutoConfig.for_model("llama4", text_config=text, vision_config=vision, image_token_index=IMAGE,
                               boi_token_index=104, eoi_token_index=105)
    ids, labels = _ids(4)
    return cfg, {"input_ids": ids, "labels": labels,
                 "pixel_values": _pixels(1, 3, 16, 16)}


def internvl():
    """InternVL: InternViT (LayerNorms, no rotary), pixel shuffle by 0.5, and a Qwen2; 4 image tokens."""
    from transformers import AutoConfig

    vision = _vision_tower("internvl_vision") | {"image_size": [16, 16], "patch_size": [4, 4]}
    cfg = AutoConfig.for_model("internvl", text_config={"model_type": "qwen2", **TEXT}, vision_config=vision,
                               image_token_id=IMAGE, downsample_ratio=0.5)
    ids, labels = _ids(4)
    return cfg, {"input_ids": ids, "labels": labels,
                 "pixel_values": _pixels(1, 3, 16, 16)}


def aya_vision(model_type: str = "aya_vision"):
    """Aya Vision / Cohere2-Vision: SigLIP, pixel shuffle by 2 and a SwiGLU projector (linear_1 to gate and
    up in one), and a Cohere 2 (interleaved RoPE, LayerNorm); 4 image tokens."""
    from transformers import AutoConfig

    image = {"image_token_index": IMAGE, "vision_feature_layer": -1} if model_type == "aya_vision" else {
        "image_token_id": IMAGE}
    cfg = AutoConfig.for_model(model_type, text_config={"model_type": "cohere2", **TEXT, "sliding_window": 8},
                               vision_config=_vision_tower("siglip_vision_model"), downsample_factor=2, **image)
    ids, labels = _ids(4)
    return cfg, {"input_ids": ids, "labels": labels,
                 "pixel_values": _pixels(1, 3, 16, 16)}


def lfm2_vl():
    """LFM2-VL: a SigLIP 2 NaFlex tower (patches flattened by the processor, their grid in spatial_shapes),
    pixel unshuffle by 2, and an LFM2 (short convolutions, then attention); 16 patches, 4 image tokens."""
    from transformers import AutoConfig

    vision = {k: v for k, v in _vision_tower("siglip2_vision_model").items() if k != "image_size"}
    cfg = AutoConfig.for_model("lfm2_vl", text_config={"model_type": "lfm2", **TEXT},
                               vision_config=vision | {"num_patches": 16}, image_token_id=IMAGE,
                               downsample_factor=2, projector_hidden_size=32)
    ids, labels = _ids(4)
    return cfg, {"input_ids": ids, "labels": labels, "spatial_shapes": torch.tensor([[4, 4]]),
                 "pixel_values": _pixels(1, 16, 3 * 4 * 4),
                 "pixel_attention_mask": torch.ones(1, 16, dtype=torch.long)}


VLMS = {"qwen2_vl": lambda: qwen_vl("qwen2_vl"), "qwen2_5_vl": lambda: qwen_vl("qwen2_5_vl"),
        "qwen3_vl": lambda: qwen_vl("qwen3_vl"), "qwen3_vl_moe": lambda: qwen_vl("qwen3_vl_moe"),
        "qwen3_5": lambda: qwen_vl("qwen3_5"), "glm4v": lambda: qwen_vl("glm4v"),
        "glm4v_moe": lambda: qwen_vl("glm4v_moe"), "llava": llava, "gemma3": gemma3, "mistral3": mistral3,
        "paligemma": paligemma, "smolvlm": lambda: idefics("smolvlm"), "llama4": llama4, "internvl": internvl,
        "aya_vision": aya_vision, "idefics3": lambda: idefics("idefics3"), "lfm2_vl": lfm2_vl,
        "cohere2_vision": lambda: aya_vision("cohere2_vision"), "vipllava": lambda: llava("vipllava"),
        "qwen3_5_moe": lambda: qwen_vl("qwen3_5_moe"), "glm46v": lambda: qwen_vl("glm46v"),
        "llava_next": lambda: llava_next("llava_next"), "llava_onevision": lambda: llava_next("llava_onevision"),
        "exaone4_5": exaone4_5, "lfm3_vl": lfm3_vl, "mllama": mllama}
