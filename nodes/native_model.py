"""A LingBot-World expert as a native ComfyUI model: core's Wan DiT plus LingBot's camera layers, weights
from the pack's own streaming loader, NF4 Linears kept 4-bit under ComfyUI's ModelPatcher.

- `LingBotWanModel` subclasses core's `comfy.ldm.wan.model.WanModel` (the Wan2.2 i2v 14B layout, in_dim 36,
  no image cross-attention) and adds upstream's camera layers under their stored names: the Plücker patch
  embedding `patch_embedding_wancamctrl` + `c2ws_hidden_states_layer1/2`, and per block `cam_injector_layer1/2`,
  `cam_scale_layer`, `cam_shift_layer`. Every layer comes from ComfyUI's `operations`, so ops classes apply.
- `LingBotWAN` is core's WAN21 model base with this DiT; its `extra_conds` turns the conditioning's
  `lingbot_camera` (a `NativeCamera`) into the camera tensor for the model's control type.
- NF4 Linears (`nf4_operations`) keep the packed weight and bitsandbytes' quantization statistics as tensors
  of the module (so ModelPatcher moves, offloads and counts them) and dequantize per layer in forward.
- `LingBotModelPatcher` applies LoRA weight patches to NF4 layers at dequantization (ComfyUI's own
  `LowVramPatch` on the dequantized weight); stored weights are never re-quantized.
"""

import math

import comfy.conds
import comfy.ldm.wan.model as core_wan
import comfy.model_base
import comfy.model_management
import comfy.model_patcher
import comfy.ops
import comfy.supported_models
import comfy.utils
import torch
import torch.nn.functional as F
from einops import rearrange

from ..wan.config import CONTROL_CHANNELS, DiTConfig
from .native_camera import CAMERA_KEY, NativeCamera

CAMERA_LINEARS = ("cam_injector_layer1", "cam_injector_layer2", "cam_scale_layer", "cam_shift_layer")
LINGBOT_SHIFT = 10.0  # upstream's sample_shift (the model's default before ModelSamplingSD3)


# ----------------------------------------------------------------------------- the DiT


class LingBotBlock(core_wan.WanAttentionBlock):
    """Core's Wan block with LingBot's camera injection between self- and cross-attention."""

    def __init__(self, *args, operation_settings={}, **kwargs):  # noqa: B006 - core's signature
        super().__init__(*args, operation_settings=operation_settings, **kwargs)
        ops = operation_settings.get("operations")
        where = {"device": operation_settings.get("device"), "dtype": operation_settings.get("dtype")}
        for name in CAMERA_LINEARS:
            setattr(self, name, ops.Linear(self.dim, self.dim, **where))

    def forward(self, x, e, freqs, context, context_img_len=257, transformer_options={}, cam=None):  # noqa: B006
        mod = comfy.model_management.cast_to(self.modulation, dtype=x.dtype, device=x.device)
        e = (mod + e).chunk(6, dim=1) if e.ndim < 4 else (mod.unsqueeze(0) + e).unbind(2)
        shift_msa, scale_msa, gate_msa, shift_ffn, scale_ffn, gate_ffn = (core_wan.repeat_e(m, x) for m in e)
        y = self.self_attn(
            torch.addcmul(shift_msa, self.norm1(x), 1 + scale_msa),
            freqs,
            transformer_options=transformer_options,
        )
        x = torch.addcmul(x, y, gate_msa)
        del y
        if cam is not None:
            h = self.cam_injector_layer2(F.silu(self.cam_injector_layer1(cam))) + cam
            x = (1.0 + self.cam_scale_layer(h)) * x + self.cam_shift_layer(h)
            del h
        x = x + self.cross_attn(
            self.norm3(x), context, context_img_len=context_img_len, transformer_options=transformer_options
        )
        y = self.ffn(torch.addcmul(shift_ffn, self.norm2(x), 1 + scale_ffn))
        return torch.addcmul(x, y, gate_ffn)


class LingBotWanModel(core_wan.WanModel):
    """Core's WanModel (model_type t2v: Wan2.2 i2v 14B has no image cross-attention; the image comes in through
    the 36 input channels) with LingBot-World's camera layers. `control_type` None: plain Wan2.2 i2v."""

    def __init__(self, control_type="cam", device=None, dtype=None, operations=None, **kwargs):
        kwargs.pop("model_type", None)
        kwargs.pop("image_model", None)
        block = LingBotBlock if control_type is not None else core_wan.WanAttentionBlock
        super().__init__(
            model_type="t2v",
            wan_attn_block_class=block,
            device=device,
            dtype=dtype,
            operations=operations,
            **kwargs,
        )
        self.control_type = control_type
        if control_type is not None:
            where = {"device": device, "dtype": dtype}
            cam_in = CONTROL_CHANNELS[control_type] * math.prod(self.patch_size)
            self.patch_embedding_wancamctrl = operations.Linear(cam_in, self.dim, **where)
            self.c2ws_hidden_states_layer1 = operations.Linear(self.dim, self.dim, **where)
            self.c2ws_hidden_states_layer2 = operations.Linear(self.dim, self.dim, **where)

    def embed_camera(self, cam: torch.Tensor, tokens: int) -> torch.Tensor:
        """Packed camera tensor [B, C, F, H, W] -> per-token conditioning [B, L, dim] (upstream's Plücker
        embedding: patchify, linear, then a residual two-layer MLP)."""
        if self.control_type is None:
            raise ValueError("this checkpoint has no camera layers (plain Wan2.2 i2v); give no camera input")
        expected = CONTROL_CHANNELS[self.control_type]
        if cam.dim() != 5 or cam.shape[1] != expected:
            raise ValueError(
                f"camera tensor: expected [B, {expected}, lat_f, lat_h, lat_w] for control_type "
                f"{self.control_type!r}, got {list(cam.shape)}"
            )
        p1, p2, p3 = self.patch_size
        flat = rearrange(cam, "b c (f c1) (h c2) (w c3) -> b (f h w) (c c1 c2 c3)", c1=p1, c2=p2, c3=p3)
        if flat.shape[1] != tokens:
            raise ValueError(
                f"the camera input gives {flat.shape[1]} tokens, the latent {tokens}: the camera was made for "
                "another width, height or length than this latent"
            )
        c = self.patch_embedding_wancamctrl(flat)
        return c + self.c2ws_hidden_states_layer2(F.silu(self.c2ws_hidden_states_layer1(c)))

    def forward_orig(self, x, t, context, clip_fea=None, freqs=None, transformer_options={}, **kwargs):  # noqa: B006
        cam_input = kwargs.get(CAMERA_KEY)
        x = self.patch_embedding(x.float()).to(x.dtype)
        grid_sizes = x.shape[2:]
        x = x.flatten(2).transpose(1, 2)

        e = self.time_embedding(
            core_wan.sinusoidal_embedding_1d(self.freq_dim, t.flatten()).to(dtype=x[0].dtype)
        )
        e = e.reshape(t.shape[0], -1, e.shape[-1])
        e0 = self.time_projection(e).unflatten(2, (6, self.dim))

        # upstream's text is text_len tokens: the prompt's, cut there (its tokenizer's limit), then zeros. ComfyUI's
        # umT5 gives at least 512 rows, zeros after the prompt.
        context = F.pad(context[:, : self.text_len], (0, 0, 0, max(0, self.text_len - context.shape[1])))
        context = self.text_embedding(context)
        cam = None if cam_input is None else self.embed_camera(cam_input.to(x.dtype), x.shape[1])

        blocks_replace = transformer_options.get("patches_replace", {}).get("dit", {})
        for i, block in enumerate(self.blocks):
            if ("double_block", i) in blocks_replace:

                def block_wrap(args, block=block):
                    out = block(
                        args["img"],
                        context=args["txt"],
                        e=args["vec"],
                        freqs=args["pe"],
                        transformer_options=args["transformer_options"],
                        cam=cam,
                    )
                    return {"img": out}

                x = blocks_replace[("double_block", i)](
                    {
                        "img": x,
                        "txt": context,
                        "vec": e0,
                        "pe": freqs,
                        "transformer_options": transformer_options,
                    },
                    {"original_block": block_wrap},
                )["img"]
            elif cam is not None:
                x = block(
                    x, e=e0, freqs=freqs, context=context, transformer_options=transformer_options, cam=cam
                )
            else:
                x = block(x, e=e0, freqs=freqs, context=context, transformer_options=transformer_options)
        x = self.head(x, e)
        return self.unpatchify(x, grid_sizes)


class LingBotWAN(comfy.model_base.WAN21):
    """Core's WAN21 model base (i2v concat conditioning, flow sampling) with the LingBot DiT."""

    def __init__(self, model_config, model_type=comfy.model_base.ModelType.FLOW, device=None):
        comfy.model_base.BaseModel.__init__(
            self, model_config, model_type, device=device, unet_model=LingBotWanModel
        )
        self.image_to_video = True

    def extra_conds(self, **kwargs):
        out = super().extra_conds(**kwargs)
        camera = kwargs.get(CAMERA_KEY)
        if camera is not None:
            tensor = (
                camera.tensor(self.diffusion_model.control_type)
                if isinstance(camera, NativeCamera)
                else camera
            )
            out[CAMERA_KEY] = comfy.conds.CONDRegular(tensor)
        return out


class LingBotModelConfig(comfy.supported_models.WAN21_T2V):
    """Never matched by ComfyUI's detection (the loader builds it); WAN21's latent format, text encoder and
    memory factor, LingBot's shift."""

    unet_config = {"image_model": "wan2.1", "model_type": "lingbot"}
    sampling_settings = {"shift": LINGBOT_SHIFT}

    def get_model(self, state_dict=None, prefix="", device=None):
        return LingBotWAN(self, device=device)


def unet_config(cfg: DiTConfig) -> dict:
    """The constructor arguments of `LingBotWanModel` for an expert config."""
    return {
        "image_model": "wan2.1",
        "model_type": "lingbot",
        "patch_size": tuple(cfg.patch_size),
        "text_len": cfg.text_len,
        "in_dim": cfg.in_dim,
        "dim": cfg.dim,
        "ffn_dim": cfg.ffn_dim,
        "freq_dim": cfg.freq_dim,
        "text_dim": cfg.text_dim,
        "out_dim": cfg.out_dim,
        "num_heads": cfg.num_heads,
        "num_layers": cfg.num_layers,
        "window_size": tuple(cfg.window_size),
        "qk_norm": cfg.qk_norm,
        "cross_attn_norm": cfg.cross_attn_norm,
        "eps": cfg.eps,
        "control_type": cfg.control_type,
    }


# ----------------------------------------------------------------------------- NF4 layers

NF4_BUFFERS = ("absmax", "code", "offset", "nested_absmax", "nested_code")


def _nf4_dequantize(m, device) -> torch.Tensor:
    """The dense weight of NF4 layer `m` on `device` (its stored 16-bit dtype), from its packed weight and
    statistics, through bitsandbytes' own dequantization."""
    import bitsandbytes.functional as bnb_f

    non_blocking = comfy.model_management.device_supports_non_blocking(device)

    def on(t):
        return (
            None if t is None else comfy.model_management.cast_to(t, device=device, non_blocking=non_blocking)
        )

    state2 = None
    if m.nf4_nested_absmax is not None:
        state2 = bnb_f.QuantState(
            absmax=on(m.nf4_nested_absmax),
            code=on(m.nf4_nested_code),
            blocksize=m.nf4_meta["nested_blocksize"],
            dtype=m.nf4_meta["nested_dtype"],
        )
    qs = bnb_f.QuantState(
        absmax=on(m.nf4_absmax),
        shape=m.nf4_meta["shape"],
        code=on(m.nf4_code),
        blocksize=m.nf4_meta["blocksize"],
        quant_type=m.nf4_meta["quant_type"],
        dtype=m.nf4_meta["dtype"],
        offset=on(m.nf4_offset),
        state2=state2,
    )
    return bnb_f.dequantize_4bit(on(m.weight), qs)


def nf4_operations(base):
    """`base` (a comfy.ops class) whose Linear also takes NF4 weights (see `install_nf4`)."""

    class Linear(base.Linear):
        nf4_meta = None  # set by install_nf4: the layer is 4-bit
        nf4_patch = None  # a LowVramPatch set by LingBotModelPatcher: LoRA patches at dequantization

        def forward(self, *args, **kwargs):
            if self.nf4_meta is not None:
                return self.forward_comfy_cast_weights(*args, **kwargs)
            return super().forward(*args, **kwargs)

        def forward_comfy_cast_weights(self, input):
            if self.nf4_meta is None:
                return super().forward_comfy_cast_weights(input)
            weight = _nf4_dequantize(self, input.device)
            functions = list(self.weight_function)
            patch = self.nf4_patch
            # partially_unload may have added ComfyUI's own LowVramPatch for this key: apply it once
            if patch is not None and not any(getattr(f, "key", None) == patch.key for f in functions):
                functions.insert(0, patch)
            if functions:  # patches (LoRA) computed in fp32, as ComfyUI patches a loaded weight
                weight = weight.float()
                for f in functions:
                    weight = f(weight)
            weight = weight.to(input.dtype)
            bias = None
            if self.bias is not None:
                bias = comfy.model_management.cast_to(
                    self.bias, input.dtype, input.device, copy=bool(self.bias_function)
                )
                for f in self.bias_function:
                    bias = f(bias)
            return F.linear(input, weight, bias)

    class Ops(base):
        pass

    Ops.Linear = Linear
    return Ops


def install_nf4(module, packed: torch.Tensor, qs) -> None:
    """Make `module` (an `nf4_operations` Linear) 4-bit: the packed weight as its `weight` parameter, bnb's
    QuantState as buffers (moved and counted with the module) plus plain metadata. No copy is made."""
    module.weight = torch.nn.Parameter(packed, requires_grad=False)
    nested = qs.state2 if getattr(qs, "nested", False) else None
    buffers = {
        "absmax": qs.absmax,
        "code": qs.code,
        "offset": qs.offset if nested is not None else None,
        "nested_absmax": None if nested is None else nested.absmax,
        "nested_code": None if nested is None else nested.code,
    }
    for name in NF4_BUFFERS:
        value = buffers[name]
        if value is not None and not isinstance(value, torch.Tensor):
            value = torch.tensor(value)
        module.register_buffer(f"nf4_{name}", value)
    module.nf4_meta = {
        "shape": tuple(qs.shape),
        "blocksize": qs.blocksize,
        "quant_type": qs.quant_type,
        "dtype": qs.dtype,
        "nested_blocksize": None if nested is None else nested.blocksize,
        "nested_dtype": None if nested is None else nested.dtype,
    }


def nf4_module(model, key: str):
    """The NF4 Linear that `key` ('diffusion_model.<layer>.weight') names, else None."""
    owner, _, attr = key.rpartition(".")
    if attr != "weight":
        return None
    try:
        module = comfy.utils.get_attr(model, owner)
    except AttributeError:
        return None
    return module if getattr(module, "nf4_meta", None) is not None else None


class LingBotModelPatcher(comfy.model_patcher.ModelPatcher):
    """ModelPatcher whose NF4 weights take their patches (LoRA) at dequantization, in forward: a patched 4-bit
    weight is never written back (that would mean re-quantizing). Everything else is ComfyUI's own."""

    def patch_weight_to_device(self, key, device_to=None, inplace_update=False):
        module = nf4_module(self.model, key)
        if module is None:
            return super().patch_weight_to_device(key, device_to=device_to, inplace_update=inplace_update)
        module.nf4_patch = (
            comfy.model_patcher.LowVramPatch(key, self.patches) if key in self.patches else None
        )

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        super().unpatch_model(device_to=device_to, unpatch_weights=unpatch_weights)
        if unpatch_weights:
            for m in self.model.modules():
                if getattr(m, "nf4_meta", None) is not None:
                    m.nf4_patch = None


# ----------------------------------------------------------------------------- building one


def build_model(cfg: DiTConfig, expert: torch.nn.Module, dtype: torch.dtype) -> LingBotModelPatcher:
    """A MODEL from an expert the pack's loader streamed in (`loaders.stream.load_expert`, on the CPU): its
    tensors move into the ComfyUI model without copies (NF4 layers stay 4-bit). `dtype`: the dense weights'
    dtype; the compute dtype is ComfyUI's choice for the device (`unet_manual_cast`)."""
    load_device = comfy.model_management.get_torch_device()
    offload_device = comfy.model_management.unet_offload_device()
    config = LingBotModelConfig(unet_config(cfg))
    manual_cast = comfy.model_management.unet_manual_cast(
        dtype, load_device, config.supported_inference_dtypes
    )
    config.set_inference_dtype(dtype, manual_cast)
    config.custom_operations = nf4_operations(
        comfy.ops.pick_operations(dtype, manual_cast, load_device=load_device)
    )
    model = LingBotWAN(config, device="meta")
    model.device = offload_device
    dit = model.diffusion_model
    for name, module in expert.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        target = dit.get_submodule(name)
        qs = getattr(params.get("weight"), "quant_state", None)
        for pname, p in params.items():
            if pname == "weight" and qs is not None:
                install_nf4(target, p.data, qs)
            else:
                data, held = p.data, target._parameters.get(pname)
                if held is not None and held.dtype != data.dtype:  # core keeps some (patch embedding) fp32
                    data = data.to(held.dtype)
                target._parameters[pname] = torch.nn.Parameter(data, requires_grad=False)
    left = [n for n, p in dit.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"the expert has no tensor for {left[:5]}{' ...' if len(left) > 5 else ''}")
    return LingBotModelPatcher(model, load_device=load_device, offload_device=offload_device)
