"""Runs Self-Forcing's `CausalInferencePipeline.inference` (the copied files beside this one) on CPU
in float32 and writes its latents: `python run.py SPEC.json OUT.npy` (README.md here says what is
changed around the copied code).

SPEC.json: {"checkpoint": a .pt in the reference's layout ({"generator_ema": {"model.<key>": tensor}}),
"model": CausalWanModel's keyword arguments, "args": the loop's config (denoising_step_list,
warp_denoising_step, num_frame_per_block, context_noise, timestep_shift), "inputs": an .npz with
noise [B, F, C, H, W], prompt_embeds [B, L, text_dim], renoise [K, ...] (the loop's randn_like draws
in call order, each shaped as the chunk), and optionally initial_latent [B, F0, C, H, W]}.
"""

import json
import os
import sys
import types

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _stub_modules():
  """The modules the copied files import but the latent loop never reaches."""
  for name, attrs in {"wan.modules.tokenizers": ["HuggingfaceTokenizer"], "wan.modules.vae": ["_video_vae"],
                      "wan.modules.t5": ["umt5_xxl"],
                      "demo_utils": [], "demo_utils.memory": ["gpu", "get_cuda_free_memory_gb", "DynamicSwapInstaller",
                                                              "move_model_to_device_with_memory_preservation"]}.items():
    module = types.ModuleType(name)
    for attr in attrs:
      setattr(module, attr, None)
    sys.modules[name] = module


def _fp32_attention(q, k, v, *args, **kwargs):
  """[B, L, N, H] attention in float32 (the reference's kernels are CUDA-only or cast to bf16 on CPU)."""
  out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                                         v.transpose(1, 2).float())
  return out.transpose(1, 2).contiguous().type_as(q)


def _save_random(net, path: str, seed: int) -> None:
  """Random weights for every parameter (the model's own init zeroes its head), saved in the layout
  of Self-Forcing's checkpoints: {"generator_ema": {"model.<key>": tensor}} (its wrapper's `model.`)."""
  gen = torch.Generator().manual_seed(seed)
  state = {}
  for key, p in net.state_dict().items():
    fan_in = max(1, p[0].numel()) if p.ndim >= 2 else 1
    if key.endswith("modulation"):
      value = 0.1 * torch.randn(p.shape, generator=gen)
    elif p.ndim >= 2:
      value = torch.randn(p.shape, generator=gen) / fan_in ** 0.5
    else:  # biases, norm gains
      value = (1.0 if "norm" in key else 0.0) + 0.1 * torch.randn(p.shape, generator=gen)
    state["model." + key] = value.to(p.dtype)
  torch.save({"generator_ema": state}, path)


def main(spec_path: str, out_path: str) -> None:
  _stub_modules()
  from wan.modules import attention, causal_model, model  # noqa: E402 (after the stubs)
  attention.flash_attention = attention.attention = _fp32_attention
  model.flash_attention = causal_model.attention = _fp32_attention
  from pipeline.causal_inference import CausalInferencePipeline
  from utils.scheduler import FlowMatchScheduler
  from utils.wan_wrapper import WanDiffusionWrapper

  spec = json.load(open(spec_path))
  args = types.SimpleNamespace(independent_first_frame=False, **spec["args"])
  net = causal_model.CausalWanModel(**spec["model"]).eval()
  if not os.path.exists(spec["checkpoint"]):
    _save_random(net, spec["checkpoint"], spec.get("seed", 0))
  state = torch.load(spec["checkpoint"], map_location="cpu")["generator_ema"]
  net.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})

  wrapper = WanDiffusionWrapper.__new__(WanDiffusionWrapper)  # its __init__ reads wan_models/: the same fields
  torch.nn.Module.__init__(wrapper)
  wrapper.model, wrapper.uniform_timestep, wrapper.seq_len = net, False, 32760
  wrapper.scheduler = FlowMatchScheduler(shift=args.timestep_shift, sigma_min=0.0, extra_one_step=True)
  wrapper.scheduler.set_timesteps(1000, training=True)
  wrapper.post_init()

  inputs = np.load(spec["inputs"])
  embeds = torch.from_numpy(inputs["prompt_embeds"])
  pipe = CausalInferencePipeline(args, "cpu", generator=wrapper, text_encoder=lambda text_prompts: {
      "prompt_embeds": embeds}, vae=types.SimpleNamespace(decode_to_pixel=lambda latents, use_cache: latents))
  cfg = spec["model"]
  b, _, _, h, w = inputs["noise"].shape
  pipe.num_transformer_blocks = cfg["num_layers"]
  pipe.frame_seq_length = (h // 2) * (w // 2)
  heads, head_dim = cfg["num_heads"], cfg["dim"] // cfg["num_heads"]

  def kv_cache(batch_size, dtype, device):  # the reference's, at the tiny model's heads
    size = (net.local_attn_size if net.local_attn_size != -1 else 32760 // pipe.frame_seq_length) * pipe.frame_seq_length
    pipe.kv_cache1 = [{"k": torch.zeros([batch_size, size, heads, head_dim], dtype=dtype),
                       "v": torch.zeros([batch_size, size, heads, head_dim], dtype=dtype),
                       "global_end_index": torch.tensor([0]), "local_end_index": torch.tensor([0])}
                      for _ in range(cfg["num_layers"])]

  def cross_cache(batch_size, dtype, device):
    pipe.crossattn_cache = [{"k": None, "v": None, "is_init": False} for _ in range(cfg["num_layers"])]

  pipe._initialize_kv_cache, pipe._initialize_crossattn_cache = kv_cache, cross_cache
  draws = [torch.from_numpy(d) for d in inputs["renoise"]]
  torch.randn_like = lambda x: draws.pop(0).reshape(x.shape).to(x.dtype)
  initial = torch.from_numpy(inputs["initial_latent"]) if "initial_latent" in inputs else None
  with torch.no_grad():
    _, latents = pipe.inference(torch.from_numpy(inputs["noise"]), ["prompt"] * b, initial_latent=initial,
                                return_latents=True)
  assert not draws, f"{len(draws)} renoising draws were not used"
  np.save(out_path, latents.numpy())


if __name__ == "__main__":
  main(*sys.argv[1:])
