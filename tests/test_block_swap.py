"""Block swap (wan/block_swap.py, ExpertSwitcher(swap_blocks=...)): outputs bit-identical to no swap
for all blocks, some blocks and with a LoRA attached; the swapper leaves nothing on the device or in
its own hands after a run, an error and an interrupt; bad settings are refused naming swap_blocks."""

import pytest
import torch
from helpers import SWAP_CFG as CFG
from helpers import counting_blocks, lora_for
from helpers import load_nf4 as load
from helpers import swap_run as run
from lingbot_world.loaders import synthetic as S
from lingbot_world.loaders.experts import ExpertSwitcher
from lingbot_world.wan.block_swap import BlockSwapper, resolve_swap_blocks
from lingbot_world.wan.lora import attach_lora


@pytest.fixture(scope="module")
def nf4_dir(tmp_path_factory):
    return S.write_nf4_expert(tmp_path_factory.mktemp("swap") / "nf4", CFG, seed=3, mode="quantize")


def block_state(model, i):
    return {k: v.clone() for k, v in model.blocks[i].state_dict().items()}


@pytest.mark.parametrize("n", [4, 2, 1])
def test_swap_is_bit_identical(nf4_dir, n):
    model = load(nf4_dir)
    want = run(model)
    before = block_state(model, 3)
    swapper = BlockSwapper(model, n)
    assert model.block_swap is swapper and swapper.indices == list(range(4 - n, 4))
    assert swapper.host_bytes > 0
    for i in swapper.indices:  # every tensor of a swapped block (4-bit data, quant state, norms) lives in it
        ptr = swapper._host[i].data_ptr()
        tensors = [*model.blocks[i].parameters(), *model.blocks[i].buffers()]
        tensors += [
            m.weight.quant_state.absmax
            for m in model.blocks[i].modules()
            if getattr(getattr(m, "weight", None), "quant_state", None) is not None
        ]
        assert len(tensors) > 10
        assert all(t.untyped_storage().data_ptr() == ptr for t in tensors)
    got = run(model)
    assert torch.equal(got, want)
    assert torch.equal(run(model), want)  # a second forward streams the blocks again
    assert not swapper._live  # nothing fetched left behind after a forward
    after = block_state(model, 3)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    swapper.unpin()
    assert model.block_swap is None and not swapper._host and not swapper._slots
    assert torch.equal(run(model), want)  # the model still works in pageable RAM


def test_swap_with_lora_attached_is_bit_identical(nf4_dir):
    model = load(nf4_dir)
    plain = run(model)
    attach_lora(model, lora_for(model))
    want = run(model)
    assert (want - plain).abs().max() > 1e-3  # the LoRA matters
    BlockSwapper(model, 3)
    assert torch.equal(run(model), want)


def test_swap_zero_is_a_no_op(nf4_dir):
    model = load(nf4_dir)
    swapper = BlockSwapper(model, 0)
    assert model.block_swap is None and swapper.host_bytes == 0


class Boom(Exception):
    pass


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_error_or_interrupt_mid_forward_drops_the_fetched_blocks(nf4_dir, exc):
    model = load(nf4_dir)
    want = run(model)
    swapper = BlockSwapper(model, 4)
    host_ptrs = {i: swapper._host[i].data_ptr() for i in swapper.indices}

    def fail(*args):
        raise exc("stop")

    handle = model.blocks[2].register_forward_pre_hook(fail)
    with pytest.raises(exc):
        run(model)
    assert not swapper._live
    for i in swapper.indices:  # every swapped tensor points back into its host buffer
        for s in swapper._slots[i]:
            t = s.get()
            assert t.untyped_storage().data_ptr() == host_ptrs[i], (i, s.name)
    handle.remove()
    assert torch.equal(run(model), want)  # and the next run is still exact


def test_close_frees_everything(nf4_dir):
    model = load(nf4_dir)
    swapper = BlockSwapper(model, 2)
    run(model)
    swapper.close()
    assert model.block_swap is None
    assert not swapper._host and not swapper._slots and not swapper._live and swapper.host_bytes == 0
    assert all(p.is_meta for p in model.blocks[3].parameters())
    assert not any(p.is_meta for p in model.blocks[1].parameters())


def test_bad_settings_are_refused(nf4_dir):
    model = load(nf4_dir)
    with pytest.raises(ValueError, match="swap_blocks"):
        BlockSwapper(model, 5)
    with pytest.raises(ValueError, match="swap_blocks"):
        BlockSwapper(model, True)
    BlockSwapper(model, 1)
    with pytest.raises(ValueError, match="already has a swapper"):
        BlockSwapper(model, 1)
    with pytest.raises(ValueError, match="WanModel"):
        BlockSwapper(torch.nn.Linear(2, 2), 1)
    assert resolve_swap_blocks("auto", 40) == 40
    assert resolve_swap_blocks("12", 40) == 12 and resolve_swap_blocks(None, 40) == 0
    for bad in (41, -1, "x", 2.5):
        with pytest.raises(ValueError, match="swap_blocks"):
            resolve_swap_blocks(bad, 40)


def test_switcher_swaps_each_load_and_releases(nf4_dir):
    paths = {"high": nf4_dir, "low": nf4_dir}
    plain = ExpertSwitcher(paths, "cpu")
    want = run(plain("high"))
    plain.close()
    switcher = ExpertSwitcher(paths, "cpu", swap_blocks=3)
    model = switcher("high")
    swapper = model.block_swap
    assert swapper is not None and swapper.indices == [1, 2, 3]
    assert torch.equal(run(model), want)
    low = switcher("low")  # the switch closes the old expert's swapper before the next load
    assert not swapper._host and low.block_swap is not None and low.block_swap is not swapper
    switcher.close()
    assert low.block_swap is None and switcher._swapper is None


def test_switcher_parking_unpins(nf4_dir):
    paths = {"high": nf4_dir, "low": nf4_dir}
    switcher = ExpertSwitcher(paths, "cpu", swap_blocks=2, ram_budget=1 << 40)
    model = switcher("high")
    want = run(model)
    swapper = model.block_swap
    switcher("low")
    assert not swapper._host and model.block_swap is None  # parked without a swapper (pageable)
    again = switcher("high")
    assert again is model and again.block_swap is not None
    assert torch.equal(run(again), want)
    switcher.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_swap_bit_identical_and_memory_returns(nf4_dir):
    model = load(nf4_dir, "cuda")
    want = run(model, "cuda")
    base = torch.cuda.memory_allocated()
    swapper = BlockSwapper(model, 3)
    assert torch.cuda.memory_allocated() < base
    assert all(swapper._host[i].is_pinned() for i in swapper.indices)
    assert torch.equal(run(model, "cuda"), want)
    swapper.unpin()
    model.to("cuda")
    torch.cuda.synchronize()
    assert torch.equal(run(model, "cuda"), want)
    assert torch.cuda.memory_allocated() == base


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_switcher_never_puts_the_swapped_blocks_on_the_card(nf4_dir):
    paths = {"high": nf4_dir, "low": nf4_dir}
    plain = ExpertSwitcher(paths, "cuda")
    want = run(plain("high"), "cuda")
    full = torch.cuda.memory_allocated()
    plain.close()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    switcher = ExpertSwitcher(paths, "cuda", swap_blocks=4)
    model = switcher("high")
    assert torch.cuda.max_memory_allocated() - base < full - base  # loaded through host RAM
    assert torch.equal(run(model, "cuda"), want)
    switcher.close()
    assert torch.cuda.memory_allocated() == base


# --- block swap with compiled blocks ----------------------------------------------------------------


def test_swap_with_compiled_blocks_is_exact_and_traces_no_more(nf4_dir):
    """The compiled block function reads each swapped block's weights from wherever the swapper put them
    this forward (fetched device copies, then host views again): same output, no retrace per fetch."""
    model = load(nf4_dir)
    want = run(model)
    model.block_runner, graphs = counting_blocks()
    try:
        assert torch.equal(run(model), want)
        traced = len(graphs)
        swapper = BlockSwapper(model, 2)
        for _ in range(3):  # every forward fetches the swapped blocks anew
            assert torch.equal(run(model), want)
            assert not swapper._live
        assert len(graphs) == traced > 0
    finally:
        model.block_runner = None


@pytest.mark.slow
def test_swap_with_real_compile_matches_eager(nf4_dir):
    from lingbot_world.wan import speed
    from lingbot_world.wan.speed import SpeedOptions

    if speed.compiler_missing(torch.device("cpu")):
        pytest.skip("no C++ compiler for inductor")
    model = load(nf4_dir)
    eager = run(model)
    model.block_runner = speed.block_runner(SpeedOptions(compile=True), "cpu")
    try:
        compiled = run(model)
        BlockSwapper(model, 3)
        swapped = [run(model) for _ in range(2)]
    finally:
        model.block_runner = None
    assert not speed._shared_runners[speed.run_block].failed
    # the same kernels on the same bytes: swapping changes nothing of the compiled result
    assert all(torch.equal(s, compiled) for s in swapped)
    # and compiled stays within a few bf16 ulps of eager (the prediction is bf16-rounded)
    assert torch.allclose(compiled, eager, rtol=0.05, atol=0.05)
    assert (compiled - eager).abs().mean() < 0.01 * eager.abs().mean()
