"""ComfyUI integration: the pack loads under any folder name, its workflow validates, and the shipped
workflow runs end to end on a real ComfyUI server (CPU, tiny random checkpoints, loopback only).

Needs a ComfyUI checkout: COMFYUI_DIR=/path/to/ComfyUI, and COMFYUI_PYTHON for its interpreter
(default: this one). Skipped otherwise.
"""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from comfyui_harness import (
    PACK_FOLDER,
    V2_MODELS,
    Server,
    build_models,
    full_size_vae,
    run_parity_script,
    scaled,
    ui_to_api,
    widget_problems,
)
from helpers import headless_chromium

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / "example_workflows" / "lingbot_world_nf4_i2v.json"
PRESET_WORKFLOW = ROOT / "example_workflows" / "lingbot_world_camera_preset.json"
NATIVE_WORKFLOW = ROOT / "example_workflows" / "lingbot_world_native_text_vae.json"
FAST_WORKFLOW = ROOT / "example_workflows" / "lingbot_world_fast_preset.json"
SMALL_CARD_WORKFLOW = ROOT / "example_workflows" / "lingbot_world_12gb.json"
CHUNKED_WORKFLOW = ROOT / "example_workflows" / "lingbot_world_fast_chunked.json"
NATIVE_KSAMPLER_WORKFLOW = ROOT / "example_workflows" / "lingbot_world_native_ksampler.json"
V2_WORKFLOWS = {
    "v2-1.3b": ROOT / "example_workflows" / "lingbot_world_v2_1_3b.json",
    "v2-14b": ROOT / "example_workflows" / "lingbot_world_v2_14b.json",
}
NODE_IDS = {
    "LingBotFastLoader",
    "LingBotFastSampler",
    "LingBotExpertsLoader",
    "LingBotTextEncode",
    "LingBotCamera",
    "LingBotCameraPreset",
    "LingBotCameraPreview",
    "LingBotVAELoader",
    "LingBotSampler",
    "LingBotVAEDecode",
    "LingBotLoRA",
    "LingBotSpeed",
    "LingBotNativeModelLoader",
    "LingBotNativeImageToVideo",
    "LingBotPlay",
}
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")

pytestmark = pytest.mark.skipif(
    not (COMFYUI_DIR and (Path(COMFYUI_DIR) / "main.py").is_file()),
    reason="set COMFYUI_DIR to a ComfyUI checkout (and COMFYUI_PYTHON to its python) to run the ComfyUI tests",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("comfyui")
    yaml = build_models(root, ROOT)
    srv = Server(Path(COMFYUI_DIR), os.environ.get("COMFYUI_PYTHON", sys.executable), root, yaml)
    try:
        srv.wait_ready()
        shutil.copy(ROOT / "examples" / "00" / "image.jpg", srv.input_dir / "lingbot_world_example_00.jpg")
        srv.object_info = srv.get("/object_info")
        yield srv
    finally:
        srv.stop()


def read_video(path: Path) -> list:
    import av

    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def tiny_prompt(server, workflow=WORKFLOW, **sampler) -> dict:
    """A shipped workflow, converted as the frontend would, shrunk to CPU test size."""
    api = ui_to_api(json.loads(workflow.read_text()), server.object_info)
    by_type = {n["class_type"]: n["inputs"] for n in api.values()}
    by_type["LingBotSampler"].update({"max_area": "64*112", "steps": 4, **sampler})
    if not isinstance(by_type["LingBotSampler"]["frame_num"], list):
        by_type["LingBotSampler"]["frame_num"] = sampler.get("frame_num", 9)
    by_type["SaveVideo"]["filename_prefix"] = "lingbot_test/run"
    return api


def saved_video(server, entry) -> list:
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1) + server.log()
    videos = [
        f
        for out in entry["outputs"].values()
        for f in out.get("images", [])
        if f["filename"].endswith(".mp4")
    ]
    assert len(videos) == 1, entry["outputs"]
    return read_video(server.output_dir / videos[0]["subfolder"] / videos[0]["filename"])


def test_pyproject_reads_with_comfyui_config_parser():
    """ComfyUI's own pyproject reader (comfy_config, the registry's field names) sees the real values."""
    if not (Path(COMFYUI_DIR) / "comfy_config" / "config_parser.py").is_file():
        pytest.skip(f"{COMFYUI_DIR} has no comfy_config/config_parser.py (ComfyUI older than the registry)")
    code = (
        "import json, sys; from comfy_config import config_parser; "
        "print(config_parser.extract_node_configuration(sys.argv[1]).model_dump_json())"
    )
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    out = subprocess.run(
        [python, "-c", code, str(ROOT)], cwd=COMFYUI_DIR, capture_output=True, text=True, timeout=scaled(120)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads(out.stdout.strip().splitlines()[-1])
    project, comfy = config["project"], config["tool_comfy"]
    assert project["name"] == "lingbot-world-nf4" and project["version"].count(".") == 2
    assert project["license"]["text"] == "Apache-2.0"
    assert project["urls"]["repository"] == "https://github.com/lingbot-world-nf4/ComfyUI-LingBot-World-NF4"
    assert "bitsandbytes>=0.48" in project["dependencies"]
    assert not [d for d in project["dependencies"] if d.startswith("torch")]
    assert comfy["publisher_id"] == "lingbot-world-nf4"
    assert comfy["display_name"] == "LingBot-World NF4"
    assert comfy["icon"].startswith(
        "https://raw.githubusercontent.com/lingbot-world-nf4/ComfyUI-LingBot-World-NF4/main/"
    )
    assert (ROOT / comfy["icon"].rsplit("/main/", 1)[1]).is_file()


def test_pack_registers_nodes_under_any_folder_name(server):
    info = server.object_info
    assert NODE_IDS <= info.keys(), f"missing: {NODE_IDS - info.keys()}\n{server.log()}"
    for node_id in NODE_IDS:
        node = info[node_id]
        assert node["category"] == "LingBot-World"
        assert node["description"], node_id
        inputs = {**node["input"]["required"], **node["input"].get("optional", {})}
        untipped = [name for name, spec in inputs.items() if not (len(spec) > 1 and spec[1].get("tooltip"))]
        assert not untipped, f"{node_id}: inputs without a tooltip: {untipped}"
    # the tiny models show up in the lists the loaders offer
    experts = info["LingBotExpertsLoader"]["input"]["required"]["high_noise_expert"][0]
    assert "lingbot-world-base-cam-nf4/high_noise_model_bnb_nf4" in experts
    assert "lingbot-world-base-cam-nf4/low_noise_model_bnb_nf4" in experts
    assert "umt5_xxl_fp16.safetensors" in info["LingBotTextEncode"]["input"]["required"]["text_encoder"][0]
    assert "lingbot_world_fast" in info["LingBotFastLoader"]["input"]["required"]["model"][0]


@pytest.mark.parametrize(
    "workflow", sorted((ROOT / "example_workflows").glob("*.json")), ids=lambda p: p.stem
)
def test_workflow_files_are_consistent(server, workflow):
    ui = json.loads(workflow.read_text())
    assert ui["version"] == 0.4
    types = {n["type"] for n in ui["nodes"]}
    assert types <= server.object_info.keys(), f"unknown node types: {types - server.object_info.keys()}"
    # every node, core ones too, saves one value per widget in the server's order (the frontend fills
    # widgets by position: a missing value shifts or drops the ones after it)
    problems = [p for n in ui["nodes"] for p in widget_problems(n, server.object_info[n["type"]]["input"])]
    assert not problems, "\n".join(problems)
    ids = {n["id"] for n in ui["nodes"]}
    for link_id, src, src_slot, dst, dst_slot, kind in ui["links"]:
        assert src in ids and dst in ids, link_id
        src_node = next(n for n in ui["nodes"] if n["id"] == src)
        dst_node = next(n for n in ui["nodes"] if n["id"] == dst)
        assert server.object_info[src_node["type"]]["output"][src_slot] == kind
        slot = dst_node["inputs"][dst_slot]
        info = server.object_info[dst_node["type"]]["input"]
        declared = {**info["required"], **info.get("optional", {})}[slot["name"]][0]
        assert slot["link"] == link_id and kind in (
            declared.split(",") if isinstance(declared, str) else [kind]
        )
    status, reply = server.validate(ui_to_api(ui, server.object_info))
    assert status == 200 and not reply.get("node_errors"), reply  # validates as shipped
    api_file = ROOT / "workflows" / "api" / f"{workflow.stem}_api.json"  # the API export, where shipped
    if api_file.is_file():
        assert ui_to_api(ui, server.object_info) == json.loads(api_file.read_text()), (
            f"{api_file.name} is out of date with {workflow.name}"
        )


def test_end_to_end_video(server):
    prompt_id = server.queue_prompt(tiny_prompt(server))
    entry = server.wait_history(prompt_id, timeout=150)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1) + server.log()
    saved = [f for out in entry["outputs"].values() for f in out.get("images", [])]
    assert len(saved) == 1, entry["outputs"]
    path = server.output_dir / saved[0]["subfolder"] / saved[0]["filename"]
    assert path.is_file() and path.name.startswith("run")

    frames = read_video(path)
    # examples/00's 1280x720 image at max_area 64*112 -> 48x112 (upstream sizing), 9 frames
    assert len(frames) == 9
    assert frames[0].shape == (48, 112, 3)
    log = server.log(400)
    assert "denoise_high" in log and "denoise_low" in log, log  # both experts ran (phase table)


def test_act2cam_keys_explicit_size_and_wired_frame_count(server):
    """An action string sets the length (7 key frames -> 9), fed to the sampler through the camera
    node's frame_num output; explicit sizing gives exactly width x height."""
    prompt = tiny_prompt(server, sizing="explicit", width=112, height=64, frame_num=["5", 1])
    cam = next(n["inputs"] for n in prompt.values() if n["class_type"] == "LingBotCamera")
    cam["action_string"] = "w-3,l-4"
    entry = server.wait_history(server.queue_prompt(prompt), timeout=90)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1) + server.log()
    (saved,) = [f for out in entry["outputs"].values() for f in out.get("images", [])]
    frames = read_video(server.output_dir / saved["subfolder"] / saved["filename"])
    assert len(frames) == 9 and frames[0].shape == (64, 112, 3)


def test_bad_inputs_fail_early_with_clear_messages(server):
    status, reply = server.submit(tiny_prompt(server, frame_num=80))
    assert status == 400
    assert "4n+1" in json.dumps(reply["node_errors"]), reply

    for field, value, message in (
        ("camera_path", "no/such/dir", "camera folder 'no/such/dir' not found"),
        ("action_string", "w-3,q-2", "unknown key(s) ['q']"),
    ):
        prompt = tiny_prompt(server)
        next(n for n in prompt.values() if n["class_type"] == "LingBotCamera")["inputs"][field] = value
        status, reply = server.submit(prompt)
        assert status == 400 and message in json.dumps(reply["node_errors"]), reply

    # an error while running: the text encoder's tokenizer input points nowhere
    prompt = tiny_prompt(server)
    next(n for n in prompt.values() if n["class_type"] == "LingBotTextEncode")["inputs"]["tokenizer"] = (
        "/no/tok"
    )
    entry = server.wait_history(server.queue_prompt(prompt), timeout=60)
    assert entry["status"]["status_str"] == "error"
    (error,) = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert error["node_type"] == "LingBotTextEncode"
    assert "tokenizer not found: /no/tok" in error["exception_message"], error


def test_interrupt_then_run_again(server):
    """An interrupt mid-sampling ends the prompt as interrupted; the next prompt runs cleanly."""
    plans = server.log(10**6).count("LingBot-World memory plan:")
    prompt_id = server.queue_prompt(tiny_prompt(server, steps=1000, seed=7))
    end = time.monotonic() + scaled(60)  # the sampler logs its memory plan just before its first step
    while time.monotonic() < end and server.log(10**6).count("LingBot-World memory plan:") == plans:
        time.sleep(0.2)
    time.sleep(2.0)
    server.request("/interrupt", {})
    entry = server.wait_history(prompt_id, timeout=60)
    events = [m[0] for m in entry["status"]["messages"]]
    assert "execution_interrupted" in events, entry["status"]
    assert "LingBotSampler" in json.dumps(entry["status"]["messages"]), entry["status"]
    assert "sampling stopped (InterruptProcessingException); experts released" in server.log(400)

    again = server.queue_prompt(tiny_prompt(server, seed=8))
    assert server.wait_history(again, timeout=150)["status"]["status_str"] == "success", server.log()


def test_fast_preset_runs_with_loras_and_one_forward_a_step(server):
    """The shipped fast preset (a step-distill LoRA per expert, guide scale 1) end to end: one transformer
    pass per step, the LoRAs read and attached, a 9-frame video."""
    prompt = tiny_prompt(server, FAST_WORKFLOW, steps=6)
    sampler = next(n["inputs"] for n in prompt.values() if n["class_type"] == "LingBotSampler")
    assert (sampler["guide_scale_low"], sampler["guide_scale_high"]) == (1.0, 1.0)
    assert sum(n["class_type"] == "LingBotLoRA" for n in prompt.values()) == 2
    entry = server.wait_history(server.queue_prompt(prompt), timeout=150)
    assert len(saved_video(server, entry)) == 9
    assert "transformer forwards: 6 run, 0 skipped" in server.log(400), server.log(400)


def test_lora_node_mode_defaults_to_side_path_and_refuses_merging_into_nf4(server):
    """A workflow saved before LingBot LoRA's optional mode widget (the fast preset as it was, 4 values)
    converts without it (the side path, as before). Asking to merge into the NF4 experts fails in the LoRA
    node, naming the files."""
    ui = json.loads(FAST_WORKFLOW.read_text())
    lora_nodes = [n for n in ui["nodes"] if n["type"] == "LingBotLoRA"]
    assert lora_nodes and all(n["widgets_values"][4] == "side path" for n in lora_nodes)
    for n in lora_nodes:
        del n["widgets_values"][4:]
    old_save = server.root / "fast_preset_before_mode.json"
    old_save.write_text(json.dumps(ui))
    prompt = tiny_prompt(server, old_save, steps=2)
    loras = [n["inputs"] for n in prompt.values() if n["class_type"] == "LingBotLoRA"]
    assert loras and all("mode" not in n for n in loras)
    assert server.object_info["LingBotLoRA"]["input"]["optional"]["mode"][0] == [
        "side path",
        "merge before quantizing",
    ]
    loras[0]["mode"] = "merge before quantizing"
    next(n for n in prompt.values() if n["class_type"] == "LingBotExpertsLoader")["inputs"][
        "quantize_to_nf4"
    ] = True
    entry = server.wait_history(server.queue_prompt(prompt), timeout=60)
    assert entry["status"]["status_str"] == "error"
    (error,) = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert error["node_type"] == "LingBotLoRA"
    message = error["exception_message"]
    assert "these experts are stored as NF4" in message and "high_noise_model_bnb_nf4" in message, error
    assert "merging needs the original bf16/fp32 experts" in message


def test_fast_chunked_workflow_runs_chunk_by_chunk(server):
    """The LingBot-World-Fast workflow end to end on a tiny Fast folder (fp32 shards quantized to NF4 while
    loading): 2 chunks (21 frames) with its window, sink and fp8 K/V, progress per chunk in the log."""
    api = ui_to_api(json.loads(CHUNKED_WORKFLOW.read_text()), server.object_info)
    by_type = {n["class_type"]: n["inputs"] for n in api.values()}
    sampler = by_type["LingBotFastSampler"]
    assert (sampler["local_attn_size"], sampler["sink_size"], sampler["kv_dtype"]) == (15, 3, "fp8")
    sampler.update({"max_area": "64*112", "length": 21, "local_attn_size": 3, "sink_size": 0})
    by_type["LingBotCameraPreset"]["preset"] = "dolly in 1 12f ease, pan right 20 8f"
    by_type["SaveVideo"]["filename_prefix"] = "lingbot_test/fast"
    entry = server.wait_history(server.queue_prompt(api), timeout=150)
    frames = saved_video(server, entry)
    assert len(frames) == 21 and frames[0].shape == (48, 112, 3)
    log = server.log(400)
    assert "LingBot-World-Fast, 21 frames at 112x48 in 2 chunks" in log and "chunk 2/2: denoise" in log, log


@pytest.mark.parametrize("kind, title", [("v2-1.3b", "1.3B"), ("v2-14b", "14B")])
def test_v2_workflow_runs_chunk_by_chunk(server, kind, title):
    """Each LingBot-World 2.0 workflow end to end on a tiny DiT in its released layout (the 1.3B's flat shards
    as bf16, the 14B's transformers/ quantized to NF4 while loading), with the model's own settings:
    2 chunks of 4 latent frames (13 + 16 = 29 frames), the documented window 18 / sink 6."""
    api = ui_to_api(json.loads(V2_WORKFLOWS[kind].read_text()), server.object_info)
    by_type = {n["class_type"]: n["inputs"] for n in api.values()}
    loader, sampler = by_type["LingBotFastLoader"], by_type["LingBotFastSampler"]
    assert (loader["model"], loader["model_kind"]) == (V2_MODELS[kind], kind)
    assert loader["quantize_to_nf4"] == (kind == "v2-14b")
    assert (sampler["shift"], sampler["local_attn_size"], sampler["sink_size"]) == (0.0, -2, -1)
    sampler.update({"max_area": "64*112", "length": 33})
    by_type["LingBotCameraPreset"]["preset"] = "dolly in 1 16f ease, pan right 20 16f"
    by_type["SaveVideo"]["filename_prefix"] = f"lingbot_test/{kind}"
    entry = server.wait_history(server.queue_prompt(api), timeout=150)
    frames = saved_video(server, entry)
    assert len(frames) == 29 and frames[0].shape == (48, 112, 3)
    log = server.log(400)
    assert f"LingBot-World 2.0 {title} causal-fast, 29 frames at 112x48 in 2 chunks" in log, log
    assert "chunk 2/2: denoise" in log, log


def test_small_card_preset_swaps_blocks_and_encodes_text_on_the_cpu(server):
    """The 12 GB preset end to end: blocks swapped to host RAM (all of the tiny experts' 2), umT5 on the CPU."""
    prompt = tiny_prompt(server, SMALL_CARD_WORKFLOW)
    loader = next(n["inputs"] for n in prompt.values() if n["class_type"] == "LingBotExpertsLoader")
    text = next(n["inputs"] for n in prompt.values() if n["class_type"] == "LingBotTextEncode")
    assert loader["swap_blocks"] == 24 and text["device"] == "cpu"
    loader["swap_blocks"] = 2  # the tiny experts have 2 blocks
    entry = server.wait_history(server.queue_prompt(prompt), timeout=150)
    assert len(saved_video(server, entry)) == 9


def test_speed_node_with_comfy_attention_and_step_cache(server):
    """LingBot Speed wired into the sampler: ComfyUI's own attention kernel and EasyCache run, and the cache
    skips forwards (reported in the log)."""
    prompt = tiny_prompt(server, steps=12)
    sampler_id = next(k for k, n in prompt.items() if n["class_type"] == "LingBotSampler")
    prompt["90"] = {
        "class_type": "LingBotSpeed",
        "inputs": {
            "attention": "comfy",
            "compile": False,
            "step_cache": "easycache",
            "cache_threshold": 5.0,
            "cache_keep_first": 2,
            "cache_keep_last": 0,
        },
    }
    prompt[sampler_id]["inputs"]["speed"] = ["90", 0]
    entry = server.wait_history(server.queue_prompt(prompt), timeout=150)
    assert len(saved_video(server, entry)) == 9
    log = server.log(400)
    skipped = [
        int(line.split(" skipped by the step cache")[0].rsplit(", ", 1)[-1])
        for line in log.splitlines()
        if "skipped by the step cache" in line
    ]
    assert skipped and skipped[-1] > 0, log


def test_templates_menu_lists_and_serves_every_workflow(server):
    """ComfyUI serves the first of example_workflows/, example/, examples/, ... under the pack's URL; the
    Templates menu lists every .json there and shows the same-name .jpg on its card."""
    listing = server.get("/api/workflow_templates")
    shipped = sorted(p.stem for p in (ROOT / "example_workflows").glob("*.json"))
    assert sorted(listing[PACK_FOLDER]) == shipped, listing
    for name in shipped:
        url = f"/api/workflow_templates/{urllib.parse.quote(PACK_FOLDER)}/{name}.json"
        assert server.get(url) == json.loads((ROOT / "example_workflows" / f"{name}.json").read_text())
        with urllib.request.urlopen(server.url + url[: -len(".json")] + ".jpg", timeout=30) as r:  # the card
            assert r.read() == (ROOT / "example_workflows" / f"{name}.jpg").read_bytes()


def test_preset_workflow_previews_the_path_and_runs(server):
    prompt = tiny_prompt(server, PRESET_WORKFLOW)
    preset = next(n["inputs"] for n in prompt.values() if n["class_type"] == "LingBotCameraPreset")
    preset.update(
        {
            "preset": "orbit left 30 around 2 + dolly in 0.5 4f ease, pan right 15 4f",
            "save_folder": "saved_preset",
        }
    )
    entry = server.wait_history(server.queue_prompt(prompt), timeout=150)
    frames = saved_video(server, entry)
    assert len(frames) == 9 and frames[0].shape == (48, 112, 3)  # the preset's 9 frames, wired to the sampler
    previews = [
        f
        for out in entry["outputs"].values()
        for f in out.get("images", [])
        if f["filename"].endswith(".png")
    ]
    assert len(previews) == 1 and previews[0]["type"] == "temp", entry["outputs"]
    from PIL import Image

    # ComfyUI puts its temp files in a "temp" folder inside --temp-directory
    with Image.open(
        server.root / "temp" / "temp" / previews[0]["subfolder"] / previews[0]["filename"]
    ) as img:
        assert img.size == (1024, 576) and len(img.getcolors(1 << 16) or [0] * 300) > 50
    assert (server.input_dir / "saved_preset" / "poses.npy").is_file()
    # the camera-path node reads the saved folder back
    again = tiny_prompt(server)
    next(n for n in again.values() if n["class_type"] == "LingBotCamera")["inputs"]["camera_path"] = (
        "saved_preset"
    )
    assert len(saved_video(server, server.wait_history(server.queue_prompt(again), timeout=150))) == 9


def native_prompt(server) -> dict:
    """The native workflow on tiny models: core CLIPLoader builds only the full-size umT5, so the tiny
    test loader (core's Wan text-encoder classes at the file's size) stands in for it; core Load VAE
    reads a full-size random Wan2.1 VAE (its architecture is fixed too)."""
    prompt = tiny_prompt(server, NATIVE_WORKFLOW)
    for node in prompt.values():
        if node["class_type"] == "CLIPLoader":
            node["class_type"] = "LingBotTestTinyWanCLIPLoader"
            node["inputs"] = {"clip_name": node["inputs"]["clip_name"]}
        if node["class_type"] == "VAELoader":
            node["inputs"]["vae_name"] = full_size_vae(server.root).name
    return prompt


def test_native_text_encoder_and_vae_run_end_to_end(server):
    """CLIP Text Encode CONDITIONING and the core VAE drive the sampler; our LATENT decodes with core
    VAE Decode the same as with LingBot VAE Decode (same VAE file)."""
    prompt = native_prompt(server)
    sampler = next(k for k, n in prompt.items() if n["class_type"] == "LingBotSampler")
    vae_file = full_size_vae(server.root).name
    prompt.update(
        {
            "900": {"class_type": "LingBotVAELoader", "inputs": {"vae_name": vae_file, "dtype": "fp32"}},
            "901": {
                "class_type": "LingBotVAEDecode",
                "inputs": {
                    "vae": ["900", 0],
                    "samples": [sampler, 0],
                    "tiling": "none",
                    "tile_height": 64,
                    "tile_width": 64,
                },
            },
            "902": {
                "class_type": "SaveImage",
                "inputs": {"images": ["901", 0], "filename_prefix": "lingbot_test/ours"},
            },
            "903": {
                "class_type": "SaveImage",
                "inputs": {
                    "images": [next(k for k, n in prompt.items() if n["class_type"] == "VAEDecode"), 0],
                    "filename_prefix": "lingbot_test/core",
                },
            },
        }
    )
    entry = server.wait_history(server.queue_prompt(prompt), timeout=300)
    frames = saved_video(server, entry)
    assert len(frames) == 9 and frames[0].shape == (48, 112, 3)
    import numpy as np
    from PIL import Image

    def pngs(node):
        files = sorted(entry["outputs"][node]["images"], key=lambda f: f["filename"])
        return np.stack(
            [np.asarray(Image.open(server.output_dir / f["subfolder"] / f["filename"])) for f in files]
        )

    ours, core = pngs("902"), pngs("903")
    assert ours.shape == core.shape == (9, 48, 112, 3)
    assert np.abs(ours.astype(int) - core.astype(int)).max() <= 2  # 8-bit rounding apart


def test_clip_text_encode_embeddings_match_ours(tmp_path):
    """ComfyUI's Wan text encoder (tokenizer, padding to 512, masking) + our CONDITIONING conversion give
    the embeddings our own encoder gives from the same umT5 file: same token count, bf16-close values."""
    import torch
    from lingbot_world.loaders.demo_assets import ensure_demo_checkpoint
    from lingbot_world.loaders.synthetic_text import spiece_model_bytes, write_hf_safetensors

    ckpt = ensure_demo_checkpoint(tmp_path / "demo")
    t5 = torch.load(ckpt / "models_t5_umt5-xxl-enc-bf16.pth", map_location="cpu", weights_only=True)
    encoder = write_hf_safetensors(
        tmp_path / "umt5.safetensors", t5, spiece=spiece_model_bytes(), dtype=torch.float16
    )
    prompts = ["a castle in the clouds", (ROOT / "examples" / "00" / "prompt.txt").read_text().strip()]
    parity = run_parity_script("comfyui_text_parity.py", encoder, *prompts, cache=tmp_path / "cache")
    for row in parity["results"]:
        assert row["comfy_padded"][1] == 512 and row["comfy"] == row["ours"], row
        assert row["max_abs_diff"] <= 0.02 * row["max_abs"], row  # a bf16 step or two


def native_ksampler_prompt(server, steps: int = 4, split: int = 2) -> dict:
    """The native template as the frontend exports it, on the tiny models: the tiny CLIP loader and the
    full-size random VAE as in `native_prompt`, a 48x112 x 9-frame video, `steps` steps split at `split`."""
    prompt = ui_to_api(json.loads(NATIVE_KSAMPLER_WORKFLOW.read_text()), server.object_info)
    samplers = []
    for node in prompt.values():
        kind, inputs = node["class_type"], node["inputs"]
        if kind == "CLIPLoader":  # core CLIPLoader builds only the full-size umT5 (see native_prompt)
            node["class_type"] = "LingBotTestTinyWanCLIPLoader"
            node["inputs"] = {"clip_name": inputs["clip_name"]}
        elif kind == "VAELoader":
            inputs["vae_name"] = full_size_vae(server.root).name
        elif kind == "LingBotNativeImageToVideo":
            inputs.update({"max_area": "64*112", "length": 9})
        elif kind == "KSamplerAdvanced":
            samplers.append(inputs)
        elif kind == "SaveVideo":
            inputs["filename_prefix"] = "lingbot_test/native"
    high, low = sorted(samplers, key=lambda s: s["start_at_step"])
    assert high["end_at_step"] == low["start_at_step"] == 26 and high["steps"] == low["steps"] == 70
    high.update({"steps": steps, "end_at_step": split})
    low.update({"steps": steps, "start_at_step": split})
    return prompt


def test_native_ksampler_template_runs_to_a_video(server):
    """The native template as shipped (core CLIP/VAE, the native loaders and conditioning, ModelSamplingSD3, two
    KSamplerAdvanced split at the boundary) runs to a video on the tiny NF4 experts."""
    entry = server.wait_history(server.queue_prompt(native_ksampler_prompt(server)), timeout=300)
    frames = saved_video(server, entry)
    assert len(frames) == 9 and frames[0].shape == (48, 112, 3)
    assert max(f.std() for f in frames) > 1.0  # a picture, not a flat frame


def test_core_easycache_runs_on_the_native_model(server):
    """Core EasyCache between ModelSamplingSD3 and the low-noise KSamplerAdvanced skips steps of the native
    model (its cache hooks see core's Wan forward) and the video still comes out."""
    prompt = native_ksampler_prompt(server, steps=10, split=2)
    low = next(
        n for n in prompt.values() if n["class_type"] == "KSamplerAdvanced" and n["inputs"]["start_at_step"]
    )
    prompt["900"] = {
        "class_type": "EasyCache",
        "inputs": {
            "model": low["inputs"]["model"],
            "reuse_threshold": 3.0,
            "start_percent": 0.0,
            "end_percent": 1.0,
            "verbose": False,
        },
    }
    low["inputs"]["model"] = ["900", 0]
    entry = server.wait_history(server.queue_prompt(prompt), timeout=300)
    assert len(saved_video(server, entry)) == 9
    skipped = [line for line in server.log(400).splitlines() if "EasyCache - skipped" in line]
    assert skipped and not skipped[-1].split("skipped ")[1].startswith("0/"), skipped


def test_native_conditioning_refuses_a_bad_length_at_queue_time(server):
    """A length that is not 4n+1 is refused when the prompt is queued, naming the widget (nothing loads)."""
    prompt = native_ksampler_prompt(server)
    next(n for n in prompt.values() if n["class_type"] == "LingBotNativeImageToVideo")["inputs"]["length"] = (
        10
    )
    status, reply = server.submit(prompt)
    assert status == 400, reply
    assert "length: expected a positive integer of the form 4n+1 (e.g. 9 or 13), got 10" in json.dumps(
        reply["node_errors"]
    ), reply


def play_prompt(server, seed: int = 3, speed: str | None = None) -> dict:
    """The chunked workflow with its sampler replaced by LingBot-World Play (same model, VAE, image and text)
    and its frames saved as images; `speed`: a LingBot Speed node with that attention wired in."""
    api = ui_to_api(json.loads(CHUNKED_WORKFLOW.read_text()), server.object_info)
    ids = {n["class_type"]: k for k, n in api.items()}
    sampler = api[ids["LingBotFastSampler"]]["inputs"]
    for name in ("LingBotFastSampler", "LingBotVAEDecode", "CreateVideo", "SaveVideo", "LingBotCameraPreset"):
        api.pop(ids[name])
    api["20"] = {
        "class_type": "LingBotPlay",
        "inputs": {
            **{k: sampler[k] for k in ("model", "vae", "image", "text")},
            "max_area": "64*112",
            "seed": seed,
            "mode": "hold",
            "local_attn_size": -2,
            "sink_size": -1,
        },
    }
    api["21"] = {
        "class_type": "SaveImage",
        "inputs": {"images": ["20", 0], "filename_prefix": "lingbot_test/play"},
    }
    if speed is not None:  # LingBot Speed's attention wired into Play
        api["22"] = {
            "class_type": "LingBotSpeed",
            "inputs": {
                "attention": speed,
                "compile": False,
                "step_cache": "none",
                "cache_threshold": 0.05,
                "cache_keep_first": 7,
                "cache_keep_last": 1,
            },
        }
        api["20"]["inputs"]["speed"] = ["22", 0]
    return api


async def play_client(url: str, frames: int, stop: bool = True, got: list | None = None) -> tuple:
    """Connect to the running node's play socket (retrying until the node runs), press W after the first frame,
    take `frames` frames into `got`, then Stop (or only close)."""
    import aiohttp
    from lingbot_world.session.play_server import parse_frame_message

    got = [] if got is None else got
    async with aiohttp.ClientSession() as http:
        end = time.monotonic() + scaled(120)
        while True:
            ws = await http.ws_connect(url + "/lingbot/play/ws")
            hello = json.loads((await ws.receive(timeout=scaled(30))).data)
            if hello["type"] == "hello":
                break
            await ws.close()
            assert time.monotonic() < end, hello
            await asyncio.sleep(0.5)
        texts = []
        while len(got) < frames:
            msg = await ws.receive(timeout=scaled(120))
            if msg.type == aiohttp.WSMsgType.BINARY:
                got.append(parse_frame_message(msg.data))
                if len(got) == 1:
                    await ws.send_str(json.dumps({"type": "key", "key": "KeyW", "down": True}))
            elif msg.type == aiohttp.WSMsgType.TEXT:
                texts.append(json.loads(msg.data))
            else:
                raise AssertionError(f"socket ended after {len(got)} frames: {texts}")
        if stop:
            await ws.send_str(json.dumps({"type": "stop"}))
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    texts.append(json.loads(msg.data))
        await ws.close()
        return hello, got, texts


def test_play_node_streams_and_returns_the_clip(server):
    """LingBot-World Play in a real ComfyUI: queued, it serves its socket on ComfyUI's server; a client takes
    frames in order, its W key moves the camera, Stop ends the prompt with every played frame saved."""
    page = urllib.request.urlopen(server.url + "/extensions/" + PACK_FOLDER + "/play.js", timeout=30).read()
    assert b"lingbot.play" in page  # the panel is served from the pack's WEB_DIRECTORY
    prompt_id = server.queue_prompt(play_prompt(server, speed="comfy"))  # ComfyUI's own attention, via Speed
    hello, frames, texts = asyncio.run(play_client(server.url, 21))
    assert hello["role"] == "control" and hello["mode"] == "hold"
    assert [f[0] for f in frames] == list(range(21))
    assert frames[-1][3][2, 3] > 0  # forward along z
    assert any(t["type"] == "end" for t in texts), texts
    entry = server.wait_history(prompt_id, timeout=scaled(60))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1) + server.log()
    images = [f for out in entry["outputs"].values() for f in out.get("images", [])]
    assert len(images) >= 21
    assert "LingBot-World Play ended (stop asked by the client)" in server.log(400)


def test_play_node_is_interrupted_cleanly(server):
    """Cancel while playing ends the prompt as interrupted and releases the model; the client's socket ends."""
    prompt_id = server.queue_prompt(play_prompt(server))

    async def run():
        got = []
        task = asyncio.create_task(play_client(server.url, 10**6, stop=False, got=got))
        end = time.monotonic() + scaled(120)
        while not got and not task.done() and time.monotonic() < end:
            await asyncio.sleep(0.2)
        assert got, "no frame arrived"
        await asyncio.to_thread(server.request, "/interrupt", {})
        try:
            await task
        except AssertionError as err:
            return str(err)
        return None

    ended = asyncio.run(run())
    entry = server.wait_history(prompt_id, timeout=scaled(60))
    events = [m[0] for m in entry["status"]["messages"]]
    assert "execution_interrupted" in events, entry["status"]
    assert ended is not None and "socket ended" in ended
    assert "LingBot-World Play stopped early; model released" in server.log(400)


@pytest.fixture
def browser(server, tmp_path):
    """The ComfyUI page in headless Chromium (selenium), once the frontend has loaded the pack's extensions."""
    with headless_chromium(tmp_path / "chrome") as driver:
        from selenium.webdriver.support.ui import WebDriverWait

        driver.get(server.url)
        # the frontend has loaded the pack's extension once the app lists it
        WebDriverWait(driver, scaled(60), 0.5).until(
            lambda d: d.execute_script(
                "return !!(window.app && window.app.extensions && "
                "window.app.extensions.some(e => e.name === 'LingBot.Play'))"
            )
        )
        yield driver


@pytest.mark.slow
def test_play_node_in_the_browser(server, browser):
    """The ComfyUI page in headless Chromium: queueing the Play node opens the play panel; W on the panel moves
    the camera in the panel's log; Stop ends the prompt with the frames saved."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    prompt_id = server.queue_prompt(play_prompt(server, seed=11))
    panel = WebDriverWait(driver, scaled(120), 0.5).until(lambda d: d.find_element(By.ID, "lingbot-play"))
    log = lambda: driver.execute_script("return window.lingbotPlayLog || []")  # noqa: E731
    WebDriverWait(driver, scaled(120), 0.5).until(lambda d: len(log()) >= 1)
    ActionChains(driver).click(panel.find_element(By.TAG_NAME, "img")).key_down("w").perform()
    WebDriverWait(driver, scaled(180), 0.5).until(lambda d: log()[-1]["z"] > 0.1)
    entries = log()
    assert [e["index"] for e in entries] == list(range(len(entries)))
    panel.find_element(By.CSS_SELECTOR, '[data-a="stop"]').click()
    entry = server.wait_history(prompt_id, timeout=scaled(60))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1) + server.log()
    assert len([f for out in entry["outputs"].values() for f in out.get("images", [])]) >= len(entries)


# Drops a workflow file on the page as a user's drag and drop does (the frontend's document "drop" handler
# reads the file and loads it); a test extension records the node types the frontend found missing.
DROP_JS = """
const [name, text] = arguments;
if (!window.lingbotTestHooked) {
  window.lingbotTestHooked = true;
  app.registerExtension({
    name: "LingBot.Test.Drop",
    async afterConfigureGraph(missing) { window.lingbotTestMissing = [...missing]; },
  });
}
window.lingbotTestMissing = null;
const files = new DataTransfer();
files.items.add(new File([text], name, { type: "application/json" }));
document.dispatchEvent(new DragEvent("drop", { dataTransfer: files, bubbles: true, cancelable: true }));
"""
# What the page holds after the drop: the missing types, its nodes and links, and the API prompt the frontend
# would queue.
GRAPH_JS = """
const done = arguments[arguments.length - 1];
app.graphToPrompt().then((p) => done({
  missing: window.lingbotTestMissing,
  nodes: app.graph.nodes.map((n) => [n.id, n.type, !!n.has_errors]),
  links: app.graph.links instanceof Map ? app.graph.links.size : Object.keys(app.graph.links).length,
  prompt: Object.fromEntries(Object.entries(p.output).map(([k, v]) => [k, v.class_type])),
}));
"""


def drop_workflow(driver, name: str, ui: dict) -> dict:
    """Drop `ui` as the file `name` on the page; the page's graph once loaded (see GRAPH_JS)."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.execute_script(DROP_JS, name, json.dumps(ui))
    WebDriverWait(driver, scaled(60), 0.2).until(
        lambda d: d.execute_script("return window.lingbotTestMissing !== null")
    )
    return driver.execute_async_script(GRAPH_JS)


@pytest.mark.slow
def test_every_template_drops_into_the_page(server, browser):
    """Each shipped template dropped on the ComfyUI page in headless Chromium loads with no missing node types,
    every node and link as in the file, and converts to a prompt of the same nodes."""
    for path in sorted((ROOT / "example_workflows").glob("*.json")):
        ui = json.loads(path.read_text())
        graph = drop_workflow(browser, path.name, ui)
        assert graph["missing"] == [], (path.name, graph["missing"])
        assert not [n for n in graph["nodes"] if n[2]], (path.name, graph["nodes"])
        assert sorted((n[0], n[1]) for n in graph["nodes"]) == sorted(
            (n["id"], n["type"]) for n in ui["nodes"]
        )
        assert graph["links"] == len(ui["links"]), path.name
        assert graph["prompt"] == {str(n["id"]): n["type"] for n in ui["nodes"]}, path.name


@pytest.mark.slow
def test_native_template_dropped_in_the_page_runs(server, browser):
    """The native template dropped on the page, its widgets set to the tiny models' size in the page (the tiny
    CLIP loader standing in for core CLIPLoader, as in `native_ksampler_prompt`), queued from the page: the
    prompt the frontend builds runs to a video."""
    ui = json.loads(NATIVE_KSAMPLER_WORKFLOW.read_text())
    tiny = native_ksampler_prompt(server)
    for node in ui["nodes"]:
        if node["type"] == "CLIPLoader":
            node["type"] = "LingBotTestTinyWanCLIPLoader"
            node["widgets_values"] = node["widgets_values"][:1]
    graph = drop_workflow(browser, NATIVE_KSAMPLER_WORKFLOW.name, ui)
    assert graph["missing"] == [] and len(graph["nodes"]) == len(ui["nodes"]), graph
    # set the widgets by name, as a user would, to the tiny prompt's values (the seed stays the page's own)
    widgets = {
        k: {n: v for n, v in node["inputs"].items() if not isinstance(v, list) and n != "noise_seed"}
        for k, node in tiny.items()
    }
    browser.execute_script(
        """
        for (const [id, values] of Object.entries(arguments[0])) {
          const node = app.graph.getNodeById(Number(id));
          for (const w of node.widgets || []) if (w.name in values) w.value = values[w.name];
        }
        """,
        widgets,
    )
    before = set(server.get("/history"))
    queue_js = "const done = arguments[arguments.length - 1]; app.queuePrompt(0, 1).then(done, (e) => done(String(e)));"
    answer = browser.execute_async_script(queue_js)  # shown if nothing was queued
    queue = server.get("/queue")
    queued = {item[1] for item in queue["queue_running"] + queue["queue_pending"]}
    queued |= set(server.get("/history")) - before
    assert len(queued) == 1, (answer, queued, server.log())
    entry = server.wait_history(queued.pop(), timeout=300)
    sent = entry["prompt"][2]  # the prompt the page built: the tiny values, not the template's
    assert {k: {n: sent[k]["inputs"][n] for n in values} for k, values in widgets.items()} == widgets
    frames = saved_video(server, entry)
    assert len(frames) == 9 and frames[0].shape == (48, 112, 3)
    assert max(f.std() for f in frames) > 1.0
