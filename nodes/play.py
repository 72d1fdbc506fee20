"""LingBot-World Play: live play inside ComfyUI. Queueing the node opens the play panel (web/comfyui/play.js) in
the ComfyUI page; the panel streams frames over a WebSocket on ComfyUI's own server (/lingbot/play/ws) and sends
keys while it has focus. Stop (or closing the panel) returns the played clip as IMAGE; Cancel interrupts it."""

import json
import logging

import torch
from aiohttp import web

from ..session.play import PlaySession
from ..session.play_server import PlayServer
from . import memory
from .fast import FAST, KIND_SINK, KIND_WINDOW, as_widgets
from .models import CATEGORY
from .sampler import image_to_input
from .speed import SPEED, SpeedOptions, check_chunked_speed
from .text import TEXT, conditioning_to_context
from .vae import VAEHandle

log = logging.getLogger("LingBot-World")
WS_ROUTE = "/lingbot/play/ws"
ACTIVE: dict = {}  # "hub": the PlayServer of the running node


class NodePlaySession(PlaySession):
    """A PlaySession whose DiT, VAE and text come from ComfyUI's links (and its model management)."""

    def __init__(self, handle, vae: VAEHandle, context: torch.Tensor, device, fp8: bool = False, **kw):
        super().__init__(handle, device, **kw)
        self.handle, self.vae_handle, self.context, self.fp8 = handle, vae, context, fp8

    def check_memory(self, image) -> None:  # ComfyUI makes room as each model loads
        return None

    def _context(self, prompt: str) -> torch.Tensor:
        return self.context.to(self.device)

    def set_prompt(self, prompt: str) -> None:
        raise ValueError(
            "prompt: the node's prompt comes from its text input; change it there and queue again"
        )

    def _load_vae(self):
        model = self.vae_handle.model
        memory.make_room(sum(p.numel() * p.element_size() for p in model.parameters()), self.device)
        return model.to(self.device)

    def _load_dit(self):
        return self.handle.model(self.device, 0, self.fp8)

    def _release(self) -> None:
        self.vae_handle.model.to("cpu")
        self.handle.release()
        memory.after_release()


async def play_ws(request):
    hub = ACTIVE.get("hub")
    if hub is not None:
        return await hub.handle_ws(request)
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    await ws.send_str(
        json.dumps({"type": "error", "message": "no LingBot-World Play node is running; queue one"})
    )
    await ws.close()
    return ws


def register_routes() -> bool:
    """Add the play route to ComfyUI's server (False outside a ComfyUI server)."""
    try:
        from server import PromptServer
    except ImportError:
        return False
    instance = getattr(PromptServer, "instance", None)
    if instance is None:
        return False
    instance.routes.get(WS_ROUTE)(play_ws)
    return True


class LingBotPlay:
    DESCRIPTION = (
        "Live play: queue it, and a panel opens in this page with the world streaming as it is made. Click the "
        "panel, then W/A/S/D move, Shift runs, Q/E down/up, arrows look, drag to look, R restarts from the image. "
        "Stop returns what was played as IMAGE frames (16 fps; Save Video them). Needs a LingBot VAE Loader VAE "
        "(frames are decoded latent frame by latent frame) and an attention window (v2's 18 / 6 is used for v1 "
        "Fast too)."
    )
    CATEGORY = CATEGORY
    FUNCTION = "play"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("frames",)
    OUTPUT_TOOLTIPS = ("Every frame played, in order (rollouts restarted with R follow each other).",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (FAST, {"tooltip": "From LingBot Fast Loader (v1 Fast, v2 14B or v2 1.3B)."}),
                "vae": ("LINGBOT_VAE", {"tooltip": "From LingBot VAE Loader (Wan2.1)."}),
                "image": ("IMAGE", {"tooltip": "The first frame, and every restart's."}),
                "max_area": (
                    "STRING",
                    {"default": "480*832", "tooltip": "Pixel area, e.g. 480*832 -> 464x832."},
                ),
                "seed": (
                    "INT",
                    {
                        "default": 42,
                        "min": 0,
                        "max": 0xFFFFFFFF,
                        "control_after_generate": True,
                        "tooltip": "Noise seed of the first rollout (each restart takes the next).",
                    },
                ),
                "mode": (
                    ["history", "hold"],
                    {
                        "tooltip": "history: a key lands in the latent frame it happened in; "
                        "hold: keys held when a chunk starts act from its first frame."
                    },
                ),
                "local_attn_size": (
                    "INT",
                    {
                        "default": KIND_WINDOW,
                        "min": KIND_WINDOW,
                        "max": 1024,
                        "tooltip": "Attention window (latent frames); -2: the model's (18).",
                    },
                ),
                "sink_size": (
                    "INT",
                    {
                        "default": KIND_SINK,
                        "min": KIND_SINK,
                        "max": 1024,
                        "tooltip": "Sink frames the window keeps; -1: the model's (6).",
                    },
                ),
            },
            "optional": {
                "text": (TEXT, {"tooltip": "From LingBot Text Encode."}),
                "positive": (
                    "CONDITIONING",
                    {"tooltip": "Instead of text: CLIP Text Encode with a wan CLIP."},
                ),
                "speed": (
                    SPEED,
                    {
                        "tooltip": "From LingBot Speed: its attention, compile (the chunks up to the window's "
                        "first roll play unseen first, while the blocks compile), fp8_linears, fp8_accumulation and "
                        "camera_cache (kept only when on)."
                    },
                ),
            },
        }

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # interactive: never answered from ComfyUI's cache

    def play(
        self,
        model,
        vae,
        image,
        max_area,
        seed,
        mode,
        local_attn_size,
        sink_size,
        text=None,
        positive=None,
        speed=None,
    ):
        from ..wan import i2v

        speed = speed or SpeedOptions()
        device = memory.torch_device()
        check_chunked_speed(speed, device, "Play")

        if (text is None) == (positive is None):
            raise ValueError(
                "text: connect LingBot Text Encode to 'text' or a CLIP Text Encode to 'positive' (one)"
            )
        if not isinstance(vae, VAEHandle):
            raise ValueError("vae: play decodes latent frame by latent frame; connect a LingBot VAE Loader")
        context = text.context if text is not None else conditioning_to_context(positive, "positive")
        img = image_to_input(image)
        window = None if local_attn_size == KIND_WINDOW else local_attn_size
        sink = None if sink_size == KIND_SINK else sink_size
        with as_widgets():
            session = NodePlaySession(
                model,
                vae,
                context,
                device,
                fp8=speed.fp8,
                seed=seed,
                compile=speed.compile,
                attention=speed.attention,
                camera_cache=speed.camera_cache,  # 'auto' runs as off here: no memory check decides it
                fp8_accum=speed.fp8_accum,
                swap=model.swap_blocks,
                local_attn_size=window,
                sink_size=sink,
                mode=mode,
                area=i2v.parse_max_area(max_area),
            )
        frames: list = []
        hub = PlayServer(session, img, "(from the text input)", record=lambda f: frames.append(f.image))
        hub.check = memory.check_interrupt
        from server import PromptServer

        if ACTIVE.get("hub") is not None:
            raise ValueError("another LingBot-World Play node is running; stop it first")
        ACTIVE["hub"] = hub
        try:
            PromptServer.instance.send_sync("lingbot.play", {"ws": WS_ROUTE})
            stats = hub.run_here(PromptServer.instance.loop)
        except BaseException:
            log.info("LingBot-World Play stopped early; model released")
            raise
        finally:
            ACTIVE.pop("hub", None)
            session.close()
        log.info("LingBot-World Play ended (%s): %s", hub.end_reason, json.dumps(stats))
        if not frames:
            raise ValueError("play: stopped before the first frame was made; nothing to return")
        clip = torch.stack(frames).float().div_(255.0)
        return (clip.to(memory.intermediate_device()),)


register_routes()
