"""The vision tower and projector (SPEC §12): each piece against a plain construction, packing against one image at
a time, image tokens at the placeholders (full forward == chunked prefill + decode), preprocessing, the K3 file
layout and config, and `openk3 info`."""

import io
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from openk3.accounting import count_parameters
from openk3.cli import main
from openk3.config import ModelConfig, get_preset
from openk3.images import ImageError, decode_image, fit_size, image_token_count, patchify, prepare_image
from openk3.interop import config_from_k3, config_to_hub, config_to_k3, load_pretrained, save_pretrained
from openk3.interop.files import TensorReader
from openk3.model import K3ForCausalLM
from openk3.model.vision import (
    ImageBatch,
    apply_rope_2d,
    interpolate_positions,
    patch_merge,
    rope_2d_angles,
    varlen_attention,
    varlen_attention_reference,
)
from train_tiny import one_thread

# a small K3-shaped language model with a small tower: odd grid sizes everywhere below
VL = {"vocab_size": 300, "hidden_size": 32, "num_layers": 4, "mla_layers": [3],
      "kda": {"num_heads": 2, "head_dim": 16},
      "mla": {"num_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
              "v_head_dim": 8},
      "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 16, "num_shared_experts": 1, "latent_dim": 16},
      "dense_hidden": 64, "attn_res_block_size": 2, "mtp_layers": 1,
      "vision": {"num_layers": 2, "hidden_size": 24, "num_heads": 3, "head_dim": 8, "intermediate_size": 40,
                 "patch_size": 4, "pos_emb_size": 5, "image_token_id": 299, "max_pixels": 64 * 64}}
IMG = 299


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


def vl_config(**vision) -> ModelConfig:
    return get_preset("k3-tiny").with_overrides({**VL, "vision": {**VL["vision"], **vision}})


def random_images(cfg: ModelConfig, grids, seed: int) -> list[ImageBatch]:
    gen = torch.Generator().manual_seed(seed)
    p = cfg.vision.patch_size
    return [ImageBatch(torch.randn(h * w, 3 * p * p, generator=gen, dtype=torch.float64), ((h, w),)) for h, w in grids]


def fp64_model(cfg: ModelConfig, seed: int) -> K3ForCausalLM:
    from random_weights import randomise

    torch.manual_seed(seed)
    model = K3ForCausalLM(cfg).double().eval()
    randomise(model, seed)
    return model


# ---- the math against plain constructions -------------------------------------------------------------------

@pytest.mark.parametrize("h, w, head_dim", [(3, 5, 8), (7, 2, 12), (1, 1, 4)])
def test_rope_2d_against_a_rotation_matrix_built_by_hand(h, w, head_dim):
    theta = 10000.0
    q = torch.randn(h * w, 2, head_dim, dtype=torch.float64) * 5
    got = apply_rope_2d(q, rope_2d_angles(h, w, head_dim, theta, dtype=torch.float64))
    for p in range(h * w):
        x, y = p % w, p // w
        R = torch.zeros(head_dim, head_dim, dtype=torch.float64)
        for j in range(head_dim // 2):  # pair j turns by x (j even) or y (j odd) times frequency j // 2
            angle = (x if j % 2 == 0 else y) * theta ** (-4 * (j // 2) / head_dim)
            c, s = math.cos(angle), math.sin(angle)
            R[2 * j:2 * j + 2, 2 * j:2 * j + 2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
        torch.testing.assert_close(got[p], q[p] @ R.T, rtol=0, atol=1e-10)


def test_rope_2d_scores_depend_only_on_the_displacement():
    h, w, d = 6, 9, 16
    angles = rope_2d_angles(h, w, d, 10000.0, dtype=torch.float64)
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    at = lambda v, x, y: apply_rope_2d(v.expand(h * w, 1, d), angles)[y * w + x, 0]  # noqa: E731
    for (x1, y1), (x2, y2), (dx, dy) in [((0, 0), (3, 1), (2, 4)), ((5, 2), (1, 0), (3, 3))]:
        torch.testing.assert_close(at(q, x1, y1) @ at(k, x2, y2), at(q, x1 + dx, y1 + dy) @ at(k, x2 + dx, y2 + dy))
    # a step along x and the same step along y are different rotations (the axes are not mixed up)
    assert not torch.allclose(at(q, 1, 0) @ at(k, 0, 0), at(q, 0, 1) @ at(k, 0, 0))


def test_patch_merge_against_an_explicit_loop():
    grids, m, D = [(4, 6), (2, 2), (6, 4)], 2, 5
    x = torch.randn(sum(h * w for h, w in grids), D)
    expected, start = [], 0
    for h, w in grids:
        for r in range(h // m):
            for c in range(w // m):
                expected.append(torch.cat([x[start + (m * r + dy) * w + m * c + dx] for dy in range(m)
                                           for dx in range(m)]))
        start += h * w
    torch.testing.assert_close(patch_merge(x, grids, m), torch.stack(expected), rtol=0, atol=0)


@pytest.mark.parametrize("lengths, scale", [([7, 3, 7, 1, 12], 1.0), ([5], 1.0), ([4, 4, 4], 40.0), ([1, 2], 1e-3)])
def test_varlen_attention_equals_the_block_diagonal_mask(lengths, scale):
    cu = torch.tensor([0] + lengths).cumsum(0)
    q, k, v = (torch.randn(sum(lengths), 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    q.data *= scale
    got, ref = varlen_attention(q, k, v, cu), varlen_attention_reference(q, k, v, cu)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_position_table_interpolation_keeps_rows_as_rows():
    S, D = 5, 3
    rows = torch.arange(S, dtype=torch.float64).view(S, 1, 1).expand(S, S, D).contiguous()  # varies along y only
    assert torch.equal(interpolate_positions(rows, S, S, "bilinear"), rows.flatten(0, 1))
    for mode in ("bilinear", "bicubic"):
        grid = interpolate_positions(rows, 3, 8, mode).view(3, 8, D)  # 3 rows, 8 columns
        assert torch.allclose(grid, grid[:, :1].expand(3, 8, D))  # constant along each row
        assert grid[0, 0, 0] < grid[1, 0, 0] < grid[2, 0, 0]  # increasing down the rows
    const = torch.full((S, S, D), 0.7, dtype=torch.float64)
    torch.testing.assert_close(interpolate_positions(const, 7, 2, "bilinear"), torch.full((14, D), 0.7,
                                                                                           dtype=torch.float64))


# ---- the tower and the language model ----------------------------------------------------------------------------

def test_packed_images_encode_as_one_image_at_a_time():
    cfg = vl_config()
    model = fp64_model(cfg, 1)
    images = random_images(cfg, [(4, 6), (2, 2), (6, 4), (4, 6)], seed=2)  # two of one size, odd mixes
    packed = model.encode_images(ImageBatch.pack(images))
    alone = torch.cat([model.encode_images(im) for im in images])
    assert packed.shape == (sum(im.token_counts(2)[0] for im in images), cfg.hidden_size)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-12)


def prompt_with_images(counts, seed):
    """Text, image, text, image, text: token ids below the placeholder id and one placeholder per image token."""
    rng = random.Random(seed)
    ids = []
    for n in counts:
        ids += [rng.randrange(256) for _ in range(rng.randint(1, 5))] + [IMG] * n
    return torch.tensor([ids + [rng.randrange(256) for _ in range(3)]])


def test_image_tokens_replace_the_placeholders_in_order():
    cfg = vl_config()
    model = fp64_model(cfg, 3)
    images = random_images(cfg, [(2, 4), (4, 2)], seed=4)
    batch = ImageBatch.pack(images)
    ids = prompt_with_images(batch.token_counts(2), seed=5)
    tokens = model.encode_images(batch)
    embeds = model.model.embed_tokens(ids).clone()
    embeds[ids == IMG] = tokens
    by_hand = model.lm_head(model.model.norm(model.model(ids, inputs_embeds=embeds)))
    torch.testing.assert_close(model(ids, images=batch).logits, by_hand, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(model(ids, image_embeds=tokens).logits, by_hand, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="4 image placeholders .* for 3 image tokens"):
        model(ids, image_embeds=tokens[:3])


def test_prefill_in_chunks_through_an_image_then_decode_equals_the_full_forward():
    cfg = vl_config()
    model = fp64_model(cfg, 6)
    batch = ImageBatch.pack(random_images(cfg, [(4, 6), (2, 2)], seed=7))
    ids = prompt_with_images(batch.token_counts(2), seed=8)
    full = model(ids, images=batch).logits
    tokens, slots = model.encode_images(batch), (ids == IMG)[0]
    cache, T, pos = model.new_cache(1), ids.shape[1], 0
    for end in (3, 7, T - 2):  # chunk ends inside the first image and between the images
        used = int(slots[:pos].sum())
        n = int(slots[pos:end].sum())
        logits = model(ids[:, pos:end], cache=cache, image_embeds=tokens[used:used + n]).logits
        torch.testing.assert_close(logits, full[:, pos:end], rtol=1e-9, atol=1e-10)
        pos = end
    for t in range(pos, T):  # decode the text after the images one token at a time
        torch.testing.assert_close(model(ids[:, t:t + 1], cache=cache).logits[:, 0], full[:, t], rtol=1e-9,
                                   atol=1e-10)


# ---- preprocessing ---------------------------------------------------------------------------------------------

def png_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def test_fit_size_stays_in_budget_on_the_grid_and_keeps_the_aspect():
    vc = get_preset("k3").vision
    rng = random.Random(0)
    for _ in range(500):
        height, width = rng.choice([rng.randint(1, 60), rng.randint(1, 5000), rng.randint(1, 40000)]), \
            rng.randint(1, 5000)
        H, W = fit_size(height, width, vc)
        assert H % 28 == 0 and W % 28 == 0 and H >= 28 and W >= 28 and H * W <= vc.max_pixels
        assert H <= max(28, height) and W <= max(28, width)  # never enlarged beyond one unit
        if min(H, W) >= 280 and min(height, width) >= 280:  # rounding down a multiple of 28 moves the ratio < 10%
            assert abs(math.log((H / W) / (height / width))) < 0.1
        assert image_token_count(height, width, vc) == (H // 28) * (W // 28)
    assert fit_size(1080, 1920, vc) == (672, 1176)  # the module docstring's example


def test_patches_are_the_conv_layout_and_height_is_height():
    p = 14
    image = torch.randint(0, 256, (28, 56, 3), dtype=torch.uint8)  # 28 rows, 56 columns
    patches = patchify(image.numpy(), p)
    assert patches.shape == (2 * 4, 3 * p * p)
    weight = torch.randn(5, 3 * p * p)
    pixels = image.permute(2, 0, 1).float().unsqueeze(0) / 127.5 - 1.0
    conv = F.conv2d(pixels, weight.view(5, 3, p, p), stride=p)  # the released Conv2d's layout
    torch.testing.assert_close(patches @ weight.T, conv[0].flatten(1).T, rtol=1e-5, atol=1e-4)
    vc = vl_config(max_pixels=10**6, patch_size=14).vision
    prepared = prepare_image(Image.fromarray(image.numpy()), vc)  # PIL sizes are (width, height)
    assert prepared.batch.grid_hws == ((2, 4),) and prepared.num_tokens == 2


def test_decode_refuses_what_is_not_a_usable_image():
    image = Image.new("RGB", (30, 20), (10, 200, 30))
    for fmt in ("PNG", "JPEG", "WEBP"):
        assert decode_image(png_bytes(image, fmt)).size == (30, 20)
    assert decode_image(png_bytes(Image.new("RGBA", (4, 4)))).mode == "RGB"
    cases = {"unsupported image format GIF": png_bytes(image, "GIF"), "not a readable image": b"no image at all",
             "corrupt": png_bytes(Image.effect_noise((64, 64), 50).convert("RGB"))[:300],
             "more than": png_bytes(Image.new("1", (9000, 9000)))}
    for reason, data in cases.items():
        with pytest.raises(ImageError, match=reason) as refused:
            decode_image(data, max_input_pixels=8000 * 8000)
        assert "object at 0x" not in str(refused.value)  # Pillow's own words name its file object


def test_same_pixels_same_digest_in_any_container():
    vc = vl_config().vision
    a = Image.effect_noise((40, 30), 60).convert("RGB")
    b = a.copy()
    b.putpixel((3, 3), (0, 0, 0))
    digest = lambda img, fmt="PNG": prepare_image(decode_image(png_bytes(img, fmt)), vc).digest  # noqa: E731
    assert digest(a) == digest(a) != digest(b)
    buf = io.BytesIO()
    a.save(buf, format="WEBP", lossless=True)
    assert prepare_image(decode_image(buf.getvalue()), vc).digest == digest(a)


# ---- config, checkpoints, info ------------------------------------------------------------------------------------

def test_config_errors_name_the_field():
    for change, field in [({"head_dim": 6}, "vision.head_dim"), ({"image_token_id": 300}, "vision.image_token_id"),
                          ({"pos_emb_interpolation": "nearest"}, "vision.pos_emb_interpolation"),
                          ({"max_pixels": 10}, "vision.max_pixels")]:
        with pytest.raises(ValueError, match=field):
            vl_config(**change)
    with pytest.raises(ValueError, match="vision.depth"):
        get_preset("k3-tiny").with_overrides({**VL, "vision": {"depth": 3}})


def test_k3_preset_is_the_released_tower_and_info_reports_it(capsys):
    vc = get_preset("k3").vision
    assert (vc.num_layers, vc.hidden_size, vc.num_heads * vc.head_dim, vc.intermediate_size, vc.patch_size,
            vc.merge_size, vc.pos_emb_size, vc.image_token_id) == (27, 1024, 1536, 4096, 14, 2, 64, 163605)
    assert main(["info", "--preset", "k3", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    c = json.loads(out[-1])
    D, Q, I = 1024, 1536, 4096
    block = 2 * D + D * 3 * Q + Q * D + 2 * D * I
    assert c["vision_breakdown"]["vision_tower"] == 3 * 14 * 14 * D + 64 * 64 * D + 27 * block + D
    assert c["vision_breakdown"]["mm_projector"] == (4 * D) ** 2 + 4 * D * 7168 + 7168
    assert c["vision_params"] == sum(c["vision_breakdown"].values())
    assert 0.39e9 < c["vision_breakdown"]["vision_tower"] < 0.41e9  # "about 0.4B" (SPEC §12)
    assert c["total_params"] == sum(c["breakdown"].values())  # the language model's totals stay apart
    assert any(line.split()[:1] == ["vision"] for line in out)
    assert count_parameters(get_preset("k3-tiny"))["vision_params"] == 0


def test_save_load_round_trip_in_the_k3_layout(tmp_path):
    cfg = vl_config()
    model = K3ForCausalLM(cfg)
    save_pretrained(model, tmp_path)
    with TensorReader(tmp_path) as reader:
        shapes = reader.shapes()
    assert shapes["vision_tower.patch_embed.proj.weight"] == (24, 3, 4, 4)
    assert shapes["vision_tower.patch_embed.pos_emb.weight"] == (5, 5, 24)
    assert shapes["vision_tower.encoder.blocks.1.wqkv.weight"] == (3 * 24, 24)
    assert {"vision_tower.encoder.final_layernorm.weight", "mm_projector.proj.0.weight",
            "mm_projector.proj.2.weight", "mm_projector.post_norm.weight"} <= set(shapes)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["media_placeholder_token_id"] == IMG and config["vision_config"]["qkv_hidden_size"] == 24
    loaded = load_pretrained(tmp_path)
    assert loaded.config == cfg
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    with pytest.raises(ValueError, match="vision"):
        config_to_hub(cfg)


def test_a_released_style_vision_config_reads_as_k3():
    released = config_to_k3(get_preset("k3"))
    vision = {k: v for k, v in released["vision_config"].items() if k != "openk3"}  # what the released file has
    cfg = config_from_k3({**released, "vision_config": vision})
    assert cfg.vision == get_preset("k3").vision
    for key, value in [("norm_type", "layernorm"), ("mm_projector_type", "patchmerger"), ("attn_bias", True),
                       ("merge_kernel_size", [2, 3]), ("init_pos_emb_width", 32)]:
        with pytest.raises(ValueError, match=f"vision_config.{key}"):
            config_from_k3({**released, "vision_config": {**vision, key: value}})
