"""Run by ComfyUI's python (cwd = the ComfyUI checkout): the native graph against the pack's own sampling loop.

Native: LingBot-World Model (native) x2 -> ModelSamplingSD3 -> LingBot-World Image To Video (native) -> two
KSamplerAdvanced (euler/simple, high expert for the first steps, the low one from the split step), optionally
LoraLoaderModelOnly. Pack: `wan.pipeline.denoise` (what LingBot-World Sampler runs) with experts from the pack's
loader at fp32 compute, its Euler scheduler on the sigmas KSamplerAdvanced used, its own first-frame latent,
mask and camera tensor. Prints one JSON line with the largest differences.

    python comfyui_native_parity.py PACK_ROOT WORK_DIR [compile]

`compile`: instead, core TorchCompileModel (inductor) on a native expert against eager (minutes on a CPU).
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, ".")

SEED, STEPS, SPLIT, SHIFT, CFG, FRAMES, WIDTH, HEIGHT = 7, 6, 2, 5.0, 4.0, 9, 112, 48


def main(pack_root: str, work: str) -> dict:
    from comfy.cli_args import args

    args.cpu = True  # as the test server runs; read when comfy.model_management is first imported
    import comfy.samplers
    import folder_paths
    import numpy as np
    import torch
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3
    from PIL import Image
    from safetensors.torch import save_file

    from nodes import KSamplerAdvanced, LoraLoaderModelOnly

    sys.path.insert(0, pack_root)
    from lingbot import load_pack

    load_pack()
    from lingbot_world.loaders.camera_files import CameraInput
    from lingbot_world.loaders.demo_assets import ensure_demo_checkpoint
    from lingbot_world.loaders.lora import LoraSpec, load_loras
    from lingbot_world.loaders.stream import load_expert
    from lingbot_world.loaders.synthetic import tiny_config, write_diffusers_expert
    from lingbot_world.nodes.native import LingBotNativeImageToVideo, LingBotNativeModelLoader
    from lingbot_world.nodes.sampler import image_to_input
    from lingbot_world.nodes.vae import LingBotVAELoader
    from lingbot_world.wan import i2v, pipeline
    from lingbot_world.wan.config import SampleConfig
    from lingbot_world.wan.schedulers import FlowEulerScheduler
    from lingbot_world.wan.vae import normalize_latent

    work = Path(work)
    models = work / "models"
    ckpt = ensure_demo_checkpoint(work / "demo")
    cfg = tiny_config()
    for name, seed in (("fp32_high", 1), ("fp32_low", 2)):
        write_diffusers_expert(models / name, cfg, seed=seed, dtype=torch.float32)
    for name in ("high", "low"):  # the demo's NF4 repack
        (models / f"nf4_{name}").symlink_to(ckpt / f"{name}_noise_model_bnb_nf4", target_is_directory=True)
    (models / "vae").mkdir()
    (models / "vae" / "wan.pth").symlink_to(ckpt / "Wan2.1_VAE.pth")
    (models / "loras").mkdir()
    g = torch.Generator().manual_seed(3)
    lora = {}
    for target, (out_f, in_f) in (
        ("blocks.0.self_attn.q", (cfg.dim, cfg.dim)),
        ("blocks.1.ffn.2", (cfg.dim, cfg.ffn_dim)),
    ):
        lora[f"diffusion_model.{target}.lora_down.weight"] = torch.randn(2, in_f, generator=g)
        lora[f"diffusion_model.{target}.lora_up.weight"] = torch.randn(out_f, 2, generator=g) * 0.1
    save_file(lora, models / "loras" / "tiny.safetensors")
    folder_paths.add_model_folder_path("diffusion_models", str(models))
    folder_paths.add_model_folder_path("vae", str(models / "vae"))
    folder_paths.add_model_folder_path("loras", str(models / "loras"))

    image = torch.from_numpy(
        np.asarray(
            Image.open(Path(pack_root) / "examples" / "00" / "image.jpg").convert("RGB"), dtype=np.float32
        )
        / 255.0
    )[None]
    camera = CameraInput.from_dir(Path(pack_root) / "examples" / "00")
    text = torch.randn(2, 512, cfg.text_dim, generator=g)
    text[:, 7:] = 0  # what CLIP Text Encode gives: real tokens, then zeros to 512
    positive, negative = [[text[:1], {"pooled_output": None}]], [[text[1:], {"pooled_output": None}]]
    vae = LingBotVAELoader().load("wan.pth", "fp32")[0]
    pos, neg, latent = LingBotNativeImageToVideo().encode(
        positive, negative, vae, image, "explicit", "480*832", WIDTH, HEIGHT, FRAMES, camera
    )

    def native(kind: str, lora_strength: float | None = None) -> torch.Tensor:
        loader = LingBotNativeModelLoader()
        experts = [loader.load(f"{kind}_{e}", "as stored", False)[0] for e in ("high", "low")]
        if lora_strength is not None:
            experts = [
                LoraLoaderModelOnly().load_lora_model_only(m, "tiny.safetensors", lora_strength)[0]
                for m in experts
            ]
        high, low = (ModelSamplingSD3().patch(m, SHIFT)[0] for m in experts)
        ks = KSamplerAdvanced()
        mid = ks.sample(
            high, "enable", SEED, STEPS, CFG, "euler", "simple", pos, neg, latent, 0, SPLIT, "enable"
        )[0]
        out = ks.sample(
            low, "disable", SEED, STEPS, CFG, "euler", "simple", pos, neg, mid, SPLIT, 10000, "disable"
        )[0]
        native.sigmas = comfy.samplers.calculate_sigmas(
            high.get_model_object("model_sampling"), "simple", STEPS
        )
        return normalize_latent(out["samples"][0].float())

    def ours(kind: str, lora_strength: float | None = None) -> torch.Tensor:
        sigmas = native.sigmas.float().cpu()

        def scheduler(solver, steps, shift, device):  # the pack's Euler on KSamplerAdvanced's sigmas
            s = FlowEulerScheduler(steps, shift, device)
            s.sigmas, s.timesteps = sigmas, sigmas[:-1] * 1000
            return s

        def experts(name):
            model = load_expert(
                models / f"{kind}_{name}", "cpu", dtype=torch.float32, compute_dtype=torch.float32
            )
            if lora_strength is not None:
                load_loras(
                    model, [LoraSpec(models / "loras" / "tiny.safetensors", lora_strength, "both")], name
                )
            return model

        size = i2v.explicit_size(WIDTH, HEIGHT)
        lat_h, lat_w, h, w = size
        img = image_to_input(image)
        y = torch.cat(
            [i2v.first_frame_mask(FRAMES, lat_h, lat_w), vae.encode(i2v.vae_input(img, FRAMES, h, w))]
        )
        cam = camera.pack(cfg.control_type, FRAMES, size, "cpu")[0]
        noise = i2v.make_noise(SEED, i2v.latent_frames(FRAMES), lat_h, lat_w)
        boundary = (
            float(sigmas[SPLIT - 1] + sigmas[SPLIT]) / 2
        )  # between the last high and the first low step
        settings = SampleConfig(
            sample_shift=SHIFT,
            sample_steps=STEPS,
            boundary=boundary,
            guide_scale=(CFG, CFG),
            solver="euler",
            seed=SEED,
        )
        saved, pipeline.make_scheduler = pipeline.make_scheduler, scheduler
        try:
            return pipeline.denoise(experts, noise, y, text[0, :7], text[1, :7], cam, settings)
        finally:
            pipeline.make_scheduler = saved

    results = {}
    for kind in ("fp32", "nf4"):
        a, b = native(kind), ours(kind)
        results[kind] = {"max_abs_diff": float((a - b).abs().max()), "max_abs": float(b.abs().max())}
    with_lora, lora_ours = native("nf4", 1.0), ours("nf4", 1.0)
    zero = native("nf4", 0.0)
    plain = native("nf4")
    results["lora"] = {
        "max_abs_diff": float((with_lora - lora_ours).abs().max()),
        "max_abs": float(lora_ours.abs().max()),
        "change": float((with_lora - plain).abs().max()),
        "zero_strength_change": float((zero - plain).abs().max()),
    }
    results["shape"] = list(plain.shape)
    results["patcher"] = patcher_checks(models, text, pos)
    results["patches"] = patch_checks(pos, neg, latent)
    results["golden"] = golden_checks(Path(pack_root) / "tests" / "golden" / "dit.safetensors")
    # bf16 weights: core keeps the patch embedding (and whatever else it builds in fp32) in fp32
    bf16 = LingBotNativeModelLoader().load("fp32_high", "bf16", False)[0].model.diffusion_model
    results["bf16"] = {
        "patch_embedding": str(bf16.patch_embedding.weight.dtype),
        "block_linear": str(bf16.blocks[0].self_attn.q.weight.dtype),
    }
    return results


def patch_checks(pos, neg, latent) -> dict:
    """ComfyUI's attention override (transformer_options' optimized_attention_override, what attention-patch
    nodes set) and a 'dit' double_block replace patch on a native expert: both are called, and passing through
    to ComfyUI's own attention and the original block (camera included) leaves the latent as it was."""
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3
    from lingbot_world.nodes.native import LingBotNativeModelLoader

    from nodes import KSamplerAdvanced

    model = ModelSamplingSD3().patch(
        LingBotNativeModelLoader().load("fp32_high", "as stored", False)[0], SHIFT
    )[0]
    calls = {"attention": 0, "block": 0}

    def attention(func, *args, **kwargs):
        calls["attention"] += 1
        return func(*args, **kwargs)

    def block(args, extra):
        calls["block"] += 1
        return extra["original_block"](args)

    patched = model.clone()
    patched.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = attention
    for i in range(len(model.model.diffusion_model.blocks)):
        patched.set_model_patch_replace(block, "dit", "double_block", i)

    def sample(m):
        ks = KSamplerAdvanced()
        return ks.sample(m, "enable", SEED, 3, CFG, "euler", "simple", pos, neg, latent, 0, 100, "disable")[0]

    plain, with_patches = sample(model)["samples"], sample(patched)["samples"]
    return {**calls, "max_abs_diff": float((plain - with_patches).abs().max())}


def golden_checks(path: Path) -> dict:
    """The native DiT (fp32, ComfyUI's plain operations) on tests/golden/dit.safetensors: upstream's tiny cam and
    plain forwards, from the stored weights and inputs. Largest difference and largest value per variant."""
    import comfy.ops
    import torch
    from lingbot_world.nodes.native_model import LingBotWanModel
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        config = json.loads(f.metadata()["golden"])["config"]
        g = {k: f.get_tensor(k) for k in f.keys()}
    weights = {k.removeprefix("weights/"): v.float() for k, v in g.items() if k.startswith("weights/")}
    out = {}
    for name, control in (("cam", "cam"), ("plain", None)):
        model = LingBotWanModel(
            control_type=control, dtype=torch.float32, operations=comfy.ops.disable_weight_init, **config
        ).eval()
        keys = model.state_dict().keys()
        model.load_state_dict({k: weights[k] for k in keys}, strict=True)
        x = torch.cat([g["x"], g["y"]])[None]
        kwargs = {"lingbot_camera": g["cam"]} if control else {}
        with torch.no_grad():
            got = model(x, g[f"t_{name}"].float(), g["context"][None], **kwargs)[0]
        want = g[f"out_{name}"]
        out[name] = {"max_abs_diff": float((got - want).abs().max()), "max_abs": float(want.abs().max())}
    return out


def patcher_checks(models, text, pos) -> dict:
    """NF4 layers stay 4-bit; one forward of the high expert with a LoRA gives the same output fully loaded,
    loaded in lowvram mode (weights cast per layer, ComfyUI's own LowVramPatch) and after partially_unload;
    unpatching leaves no patch behind (the plain model's output again)."""
    import torch
    from lingbot_world.nodes.native import LingBotNativeModelLoader

    from nodes import LoraLoaderModelOnly

    cpu = torch.device("cpu")
    plain = LingBotNativeModelLoader().load("nf4_high", "as stored", False)[0]
    lora = LoraLoaderModelOnly().load_lora_model_only(plain, "tiny.safetensors", 1.0)[0]
    dit = plain.model.diffusion_model
    four_bit = [m for m in dit.modules() if getattr(m, "nf4_meta", None) is not None]
    linears = [m for m in dit.modules() if isinstance(m, torch.nn.Linear)]
    cond = pos[0][1]
    cam = cond["lingbot_camera"].tensor(dit.control_type)
    lat_f, lat_h, lat_w = cam.shape[2:]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 36, lat_f, lat_h, lat_w, generator=g)
    t = torch.tensor([800.0])

    def forward(patcher, lowvram=0, unload=False):
        patcher.patch_model(device_to=cpu, lowvram_model_memory=lowvram)
        try:
            if unload:
                patcher.partially_unload(cpu, memory_to_free=1 << 40)
            with torch.no_grad():
                return dit(x, t, text[:1], lingbot_camera=cam).float()
        finally:
            patcher.unpatch_model(device_to=cpu)

    before = forward(plain)
    full = forward(lora)
    low = forward(lora, lowvram=1)
    unloaded = forward(lora, unload=True)
    after = forward(plain)
    return {
        "four_bit_layers": len(four_bit),
        "linear_layers": len(linears),
        "packed_dtypes": sorted({str(m.weight.dtype) for m in four_bit}),
        "lora_change": float((full - before).abs().max()),
        "lowvram_diff": float((low - full).abs().max()),
        "partially_unloaded_diff": float((unloaded - full).abs().max()),
        "unpatched_diff": float((after - before).abs().max()),
    }


def compile_check(pack_root: str, work: str) -> dict:
    """Core TorchCompileModel (inductor) on a native fp32 expert: the same latent as eager, 3 Euler steps."""
    from comfy.cli_args import args

    args.cpu = True
    import folder_paths
    import torch
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    from nodes import KSamplerAdvanced

    sys.path.insert(0, pack_root)
    from lingbot import load_pack

    load_pack()
    from lingbot_world.loaders.synthetic import tiny_config, write_diffusers_expert
    from lingbot_world.nodes.native import LingBotNativeModelLoader

    cfg = tiny_config()
    models = Path(work) / "models"
    write_diffusers_expert(models / "expert", cfg, seed=1, dtype=torch.float32)
    folder_paths.add_model_folder_path("diffusion_models", str(models))
    model = LingBotNativeModelLoader().load("expert", "as stored", False)[0]
    model = ModelSamplingSD3().patch(model, SHIFT)[0]
    g = torch.Generator().manual_seed(0)
    shape = (1, 16, 3, HEIGHT // 8, WIDTH // 8)
    extra = {
        "concat_latent_image": torch.randn(*shape, generator=g),
        "concat_mask": torch.ones(1, 1, *shape[2:]),
        "lingbot_camera": torch.randn(1, 384, *shape[2:], generator=g),
    }
    cond = [[torch.randn(1, cfg.text_len, cfg.text_dim, generator=g), {"pooled_output": None, **extra}]]
    latent = {"samples": torch.zeros(shape)}

    def sample(m):
        ks = KSamplerAdvanced()
        return ks.sample(m, "enable", SEED, 3, CFG, "euler", "simple", cond, cond, latent, 0, 100, "disable")[
            0
        ]

    eager = sample(model)["samples"]
    compiled = sample(TorchCompileModel.execute(model, "inductor")[0])["samples"]
    return {"max_abs_diff": float((compiled - eager).abs().max()), "max_abs": float(eager.abs().max())}


if __name__ == "__main__":
    if sys.argv[3:] == ["compile"]:
        print("PARITY " + json.dumps(compile_check(sys.argv[1], sys.argv[2])))
    else:
        print("PARITY " + json.dumps(main(sys.argv[1], sys.argv[2])))
