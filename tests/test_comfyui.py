"""ComfyUI integration: the pack loads under any folder name, its workflow validates, and the shipped
workflow runs end to end on a real ComfyUI server (CPU, tiny random checkpoints, loopback only).

Needs a ComfyUI checkout: COMFYUI_DIR=/path/to/ComfyUI, and COMFYUI_PYTHON for its interpreter
(default: this one). Skipped otherwise.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from comfyui_harness import Server, build_models, ui_to_api

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / "workflows" / "lingbot_world_nf4_i2v.json"
API_WORKFLOW = ROOT / "workflows" / "api" / "lingbot_world_nf4_i2v_api.json"
NODE_IDS = {
    "LingBotExpertsLoader",
    "LingBotTextEncode",
    "LingBotCamera",
    "LingBotVAELoader",
    "LingBotSampler",
    "LingBotVAEDecode",
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


def tiny_prompt(server, **sampler) -> dict:
    """The shipped workflow, converted as the frontend would, shrunk to CPU test size."""
    api = ui_to_api(json.loads(WORKFLOW.read_text()), server.object_info)
    by_type = {n["class_type"]: n["inputs"] for n in api.values()}
    by_type["LingBotSampler"].update({"max_area": "64*112", "frame_num": 9, "steps": 4, **sampler})
    by_type["SaveVideo"]["filename_prefix"] = "lingbot_test/run"
    return api


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
        [python, "-c", code, str(ROOT)], cwd=COMFYUI_DIR, capture_output=True, text=True, timeout=120
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


def test_workflow_files_are_consistent(server):
    ui = json.loads(WORKFLOW.read_text())
    assert ui["version"] == 0.4
    types = {n["type"] for n in ui["nodes"]}
    assert types <= server.object_info.keys(), f"unknown node types: {types - server.object_info.keys()}"
    ids = {n["id"] for n in ui["nodes"]}
    for link_id, src, src_slot, dst, dst_slot, kind in ui["links"]:
        assert src in ids and dst in ids, link_id
        src_node = next(n for n in ui["nodes"] if n["id"] == src)
        dst_node = next(n for n in ui["nodes"] if n["id"] == dst)
        assert server.object_info[src_node["type"]]["output"][src_slot] == kind
        assert (
            dst_node["inputs"][dst_slot]["link"] == link_id and dst_node["inputs"][dst_slot]["type"] == kind
        )
    api = ui_to_api(ui, server.object_info)
    assert api == json.loads(API_WORKFLOW.read_text()), (
        f"{API_WORKFLOW.name} is out of date with {WORKFLOW.name}"
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
    prompt_id = server.queue_prompt(tiny_prompt(server, steps=1000, seed=7))
    end = time.monotonic() + 60
    while time.monotonic() < end and not server.get("/queue")["queue_running"]:
        time.sleep(0.2)
    time.sleep(2.0)  # cached upstream nodes: the sampler is running by now
    server.request("/interrupt", {})
    entry = server.wait_history(prompt_id, timeout=60)
    events = [m[0] for m in entry["status"]["messages"]]
    assert "execution_interrupted" in events, entry["status"]
    assert "LingBotSampler" in json.dumps(entry["status"]["messages"]), entry["status"]
    assert "sampling stopped (InterruptProcessingException); experts released" in server.log(400)

    again = server.queue_prompt(tiny_prompt(server, seed=8))
    assert server.wait_history(again, timeout=60)["status"]["status_str"] == "success", server.log()
