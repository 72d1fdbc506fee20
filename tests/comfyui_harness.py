"""Run a real ComfyUI server on the CPU for the integration tests, and talk to it over HTTP.

Also converts a UI-format (v0.4) workflow to the API format with the server's /object_info, the
way ComfyUI's frontend does for "Export (API)": widget values are matched to the node's widget
inputs in declaration order (required, then optional), a seed's control_after_generate and an
image upload button each take one extra slot; optional widgets past the saved values keep their
defaults (a workflow saved before they were added).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
# The pack's folder name under custom_nodes: not a Python identifier (hyphens, a dot), so the pack must
# import itself relatively. No spaces: ComfyUI serves the Templates route under the folder name through
# aiohttp, which matches a space-quoted prefix against the unquoted path and answers 404 (test_pack.py
# covers loading from a folder name with spaces).
PACK_FOLDER = "LingBot-World-NF4_pack.v2"
FAST_LORAS = (
    "wan2.2_i2v_lightx2v_4steps_lora_v1_high_noise.safetensors",
    "wan2.2_i2v_lightx2v_4steps_lora_v1_low_noise.safetensors",
)  # what the fast-preset workflow names
FAST_MODEL = "lingbot_world_fast"  # what the Fast workflow names
V2_MODELS = {  # what the v2 workflows name: the 1.3B's folder, the 14B's transformers/ inside its repo folder
    "v2-1.3b": "lingbot-world-v2-1.3b-causal-fast",
    "v2-14b": "lingbot-world-v2-14b-causal-fast/transformers",
}
TESTS = Path(__file__).resolve().parent
# Every wait below is for an idle machine; a busy 2-core CPU runs a tiny prompt 2-3x slower, so each limit is
# multiplied by LINGBOT_COMFYUI_TIMEOUT_SCALE (default 4; raise it on a slower or shared machine).
TIMEOUT_SCALE = float(os.environ.get("LINGBOT_COMFYUI_TIMEOUT_SCALE", "4"))


def scaled(seconds: float) -> float:
    """A time limit for this machine: `seconds` on an idle one, times LINGBOT_COMFYUI_TIMEOUT_SCALE."""
    return seconds * TIMEOUT_SCALE


def run_parity_script(script: str, *args, cache: Path, timeout: float = 300) -> dict:
    """tests/`script` PACK_ROOT ARGS run by ComfyUI's python (COMFYUI_PYTHON) in COMFYUI_DIR with its
    LINGBOT_WORLD_CACHE in `cache`; the JSON of its `PARITY ` line."""
    run = subprocess.run(
        [
            os.environ.get("COMFYUI_PYTHON", sys.executable),
            str(TESTS / script),
            str(TESTS.parent),
            *map(str, args),
        ],
        cwd=os.environ["COMFYUI_DIR"],
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
        env={**os.environ, "LINGBOT_WORLD_CACHE": str(cache)},
    )
    line = next((x for x in run.stdout.splitlines() if x.startswith("PARITY ")), None)
    assert line, run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads(line.removeprefix("PARITY "))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_widget(spec) -> bool:
    kind = spec[0]
    return isinstance(kind, list) or kind in WIDGET_TYPES


CONTROL_AFTER_GENERATE = ("fixed", "increment", "decrement", "randomize")


def _widget_value_ok(spec, value) -> bool:
    kind = spec[0]
    if kind == "CONTROL":  # a seed's control_after_generate
        return value in CONTROL_AFTER_GENERATE
    if kind == "BOOLEAN":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "INT":
        return isinstance(value, int)
    if kind == "FLOAT":
        return isinstance(value, (int, float))
    if isinstance(kind, list) and kind and not isinstance(kind[0], str):  # a combo of numbers
        return value in kind
    return isinstance(value, str)  # STRING and combos (the server checks a combo's choice)


def widget_problems(node: dict, inputs: dict) -> list:
    """Where a UI-format node's saved `widgets_values` do not match its widgets one for one: the count (every
    widget, optional ones included, in declaration order; a seed's control_after_generate and an image
    upload button take a slot each) and each value's type. `inputs`: the node's {'required', 'optional'} as
    /object_info or INPUT_TYPES gives them."""
    slots = []
    for name, spec in {**inputs.get("required", {}), **inputs.get("optional", {})}.items():
        if _is_widget(spec):
            slots.append((name, spec))
            opts = spec[1] if len(spec) > 1 else {}
            if opts.get("control_after_generate"):
                slots.append((f"{name}: control_after_generate", ("CONTROL",)))
            elif opts.get("image_upload"):
                slots.append((f"{name}: upload", ("STRING",)))
    values = node.get("widgets_values") or []
    where = f"node {node['id']} ({node['type']})"
    if len(values) != len(slots):
        return [
            f"{where}: {len(values)} widget values saved for {len(slots)} widgets {[n for n, _ in slots]}"
        ]
    return [
        f"{where}: widget {name!r} holds {value!r}"
        for (name, spec), value in zip(slots, values, strict=True)
        if not _widget_value_ok(spec, value)
    ]


def ui_to_api(ui: dict, object_info: dict) -> dict:
    """UI workflow -> API prompt {id: {class_type, inputs, _meta}}; muted/bypassed nodes left out."""
    links = {link[0]: link for link in ui["links"]}
    api = {}
    for node in ui["nodes"]:
        if node.get("mode", 0) in (2, 4):
            continue
        info = object_info[node["type"]]
        optional = info["input"].get("optional", {})
        specs = {**info["input"].get("required", {}), **optional}
        linked = {i["name"]: links[i["link"]] for i in node.get("inputs", []) if i.get("link") is not None}
        values = list(node.get("widgets_values") or [])
        inputs = {}
        for name, spec in specs.items():
            if _is_widget(spec) and not values and name in optional and name not in linked:
                continue  # an optional widget added after the workflow was saved: the node's default
            if _is_widget(spec):
                value = values.pop(0)  # a widget turned into an input keeps its slot
                opts = spec[1] if len(spec) > 1 else {}
                if opts.get("control_after_generate") or opts.get("image_upload"):
                    values.pop(0)
                if name not in linked:
                    inputs[name] = value
            if name in linked:
                link = linked[name]
                inputs[name] = [str(link[1]), link[2]]
        if values:
            raise ValueError(f"node {node['id']} ({node['type']}): unused widget values {values}")
        api[str(node["id"])] = {
            "class_type": node["type"],
            "inputs": inputs,
            "_meta": {"title": node.get("title") or info["display_name"]},
        }
    return api


class Server:
    """`python main.py --cpu` on a free loopback port, with its own input/output/user folders.
    COMFYUI_TEST_GPU=1 leaves out --cpu (same tiny models, on the GPU)."""

    def __init__(self, comfy_dir: Path, python: str, root: Path, extra_paths_yaml: Path):
        self.root = root
        self.input_dir, self.output_dir = root / "input", root / "output"
        for d in (self.input_dir, self.output_dir, root / "temp", root / "user"):
            d.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = root / "comfyui.log"
        env = {**os.environ, "LINGBOT_WORLD_CACHE": str(root / "cache"), "PYTHONUNBUFFERED": "1"}
        device = [] if os.environ.get("COMFYUI_TEST_GPU") == "1" else ["--cpu"]
        cmd = [
            python,
            "main.py",
            *device,
            "--listen",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--extra-model-paths-config",
            str(extra_paths_yaml),
            "--input-directory",
            str(self.input_dir),
            "--output-directory",
            str(self.output_dir),
            "--temp-directory",
            str(root / "temp"),
            "--user-directory",
            str(root / "user"),
            "--database-url",
            "sqlite:///:memory:",
            "--preview-method",
            "latent2rgb",
            "--disable-auto-launch",
        ]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=comfy_dir, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self, lines: int = 60) -> str:
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float = 150.0) -> None:
        timeout = scaled(timeout)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with status {self.proc.returncode}:\n{self.log()}")
            try:
                self.get("/system_stats")
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        raise TimeoutError(f"ComfyUI did not answer within {timeout:g} s:\n{self.log()}")

    def request(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
        return json.loads(raw) if raw else None

    def get(self, path: str):
        return self.request(path)

    def submit(self, prompt: dict) -> tuple[int, dict]:
        """POST /prompt -> (HTTP status, reply); 400 carries ComfyUI's validation errors."""
        try:
            return 200, self.request("/prompt", {"prompt": prompt, "client_id": "lingbot-test"})
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def validate(self, prompt: dict) -> tuple[int, dict]:
        """Submit for ComfyUI's validation only: the queued run is dropped (or interrupted, if it already
        started) and waited out, so full-size shipped workflows never occupy the CPU test server."""
        status, reply = self.submit(prompt)
        prompt_id = reply.get("prompt_id") if status == 200 else None
        if prompt_id:
            self.drain(prompt_id)
        return status, reply

    def drain(self, prompt_id: str | None = None) -> None:
        """Drop `prompt_id` from the queue and interrupt it (None: clear the whole queue and interrupt
        whatever runs), then wait until it no longer runs, so the next prompt starts on an idle server."""
        self.request("/queue", {"delete": [prompt_id]} if prompt_id else {"clear": True})
        interrupt = {"prompt_id": prompt_id} if prompt_id else {}
        end = time.monotonic() + scaled(60)
        while time.monotonic() < end:
            self.request("/interrupt", interrupt)
            queue = self.get("/queue")
            items = queue["queue_running"] + queue["queue_pending"]
            if not any(prompt_id in (None, item[1]) for item in items):
                return
            time.sleep(0.2)

    def queue_prompt(self, prompt: dict) -> str:
        status, reply = self.submit(prompt)
        assert status == 200 and not reply.get("node_errors"), f"/prompt rejected the workflow: {reply}"
        return reply["prompt_id"]

    def wait_history(self, prompt_id: str, timeout: float) -> dict:
        """The prompt's history entry once it succeeded or failed, within `timeout` seconds (scaled); past
        that the queue is cleared and the run interrupted, so a slow prompt cannot delay the next test."""
        timeout = scaled(timeout)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                if entry["status"]["status_str"] in ("success", "error"):
                    return entry
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI died:\n{self.log()}")
            time.sleep(0.5)
        log = self.log()
        self.drain()
        raise TimeoutError(
            f"prompt {prompt_id} did not finish within {timeout:g} s (LINGBOT_COMFYUI_TIMEOUT_SCALE="
            f"{TIMEOUT_SCALE:g}); the queue was cleared:\n{log}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def build_models(root: Path, pack_root: Path) -> Path:
    """A models folder in ComfyUI's usual layout from the tiny demo checkpoint, with the file names
    the shipped workflow expects; returns the extra_model_paths yaml for it (pack under an odd name)."""
    from lingbot_world.loaders.demo_assets import ensure_demo_checkpoint
    from lingbot_world.loaders.synthetic_text import spiece_model_bytes, write_hf_safetensors
    from safetensors.torch import save_file

    ckpt = ensure_demo_checkpoint(root / "demo")
    models = root / "models"
    experts = models / "diffusion_models" / "lingbot-world-base-cam-nf4"
    for name in ("high_noise_model_bnb_nf4", "low_noise_model_bnb_nf4"):
        shutil.copytree(ckpt / name, experts / name)
    # the Fast workflow's model: one tiny cam DiT as fp32 diffusers shards, as robbyant/lingbot-world-fast ships
    from lingbot_world.loaders.checkpoints import resolve_checkpoint_dir
    from lingbot_world.loaders.synthetic import write_diffusers_expert

    fast_config = resolve_checkpoint_dir(ckpt).config
    write_diffusers_expert(
        models / "diffusion_models" / FAST_MODEL, fast_config, seed=11, dtype=torch.float32, shards=2
    )
    # the v2 workflows' models in their released layouts (no config.json for the 1.3B: num_heads = dim / 128);
    # their text encoder and VAE are the umT5 and VAE files below
    from lingbot_world.loaders.synthetic import tiny_config, write_v2_1_3b, write_v2_14b_dit

    v2_config = tiny_config(dim=256, num_heads=2, ffn_dim=256, text_len=512)
    write_v2_1_3b(models / "diffusion_models" / V2_MODELS["v2-1.3b"], v2_config, seed=12)
    write_v2_14b_dit(models / "diffusion_models" / Path(V2_MODELS["v2-14b"]).parent, v2_config, seed=13)
    (models / "text_encoders").mkdir(parents=True)
    t5 = torch.load(ckpt / "models_t5_umt5-xxl-enc-bf16.pth", map_location="cpu", weights_only=True)
    write_hf_safetensors(
        models / "text_encoders" / "umt5_xxl_fp16.safetensors",
        t5,
        spiece=spiece_model_bytes(),
        dtype=torch.float16,
    )
    (models / "vae").mkdir(parents=True)
    vae = torch.load(ckpt / "Wan2.1_VAE.pth", map_location="cpu", weights_only=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in vae.items()},
        models / "vae" / "wan_2.1_vae.safetensors",
    )

    # The fast-preset workflow's step-distill LoRAs, as tiny random kohya-style files for the tiny experts.
    from lingbot_world.loaders.checkpoints import resolve_checkpoint_dir
    from lingbot_world.loaders.formats import meta_model
    from lingbot_world.wan.lora import lora_targets

    (models / "loras").mkdir(parents=True)
    targets = lora_targets(meta_model(resolve_checkpoint_dir(ckpt).config))
    for seed, name in enumerate(FAST_LORAS):
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for target in ("blocks.0.self_attn.q", "blocks.1.ffn.2"):
            out_f, in_f = targets[target].weight
            tensors[f"diffusion_model.{target}.lora_down.weight"] = torch.randn(2, in_f, generator=g)
            tensors[f"diffusion_model.{target}.lora_up.weight"] = torch.randn(out_f, 2, generator=g) * 0.1
        save_file(tensors, models / "loras" / name)

    nodes = root / "custom_nodes"
    nodes.mkdir()
    (nodes / PACK_FOLDER).symlink_to(pack_root, target_is_directory=True)
    (nodes / "lingbot_test_tiny_clip").symlink_to(TESTS / "comfyui_tiny_clip", target_is_directory=True)
    yaml = root / "extra_model_paths.yaml"
    yaml.write_text(
        "lingbot_test:\n"
        f"  base_path: {root}\n"
        "  custom_nodes: custom_nodes\n"
        "  diffusion_models: models/diffusion_models\n"
        "  text_encoders: models/text_encoders\n"
        "  vae: models/vae\n"
        "  loras: models/loras\n"
    )
    return yaml


def full_size_vae(root: Path) -> Path:
    """A random Wan2.1 VAE at its real size (core Load VAE builds only that), once per server root."""
    path = root / "models" / "vae" / "wan_2.1_vae_full_random.safetensors"
    if not path.is_file():
        from lingbot_world.wan.vae import WAN21_VAE_CONFIG, WanVAE, init_random_
        from safetensors.torch import save_file

        vae = init_random_(WanVAE(**WAN21_VAE_CONFIG), seed=5)
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in vae.state_dict().items()}, path)
    return path
