"""Decode context parallelism from Python (docs/dcp.md): attnrt.DcpAttention (n simulated ranks in
one process) against one attnrt.Runtime holding everything, over a serving-like sequence of steps:
prompts, a chunk over the cached prefix, decodes, a chain verify and a tree verify with its
accepted paths committed; and attnrt.DcpRank on a thread per rank (in_process_group) against the
group, bit for bit. GQA and MLA layers, 2 and 3 ranks, pages of 1 and 16; the errors of misuse.

Inputs are drawn fresh from a seed printed with every failure (ATTNRT_TEST_SEED replays one)."""
import concurrent.futures
import time

import pytest

torch = pytest.importorskip("torch")
attnrt = pytest.importorskip("attnrt")

CUDA_OK, _ = attnrt.cuda_status()
GPU = CUDA_OK and torch.cuda.is_available()


def gqa_config():
    return {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 6,
            "num_key_value_heads": 2, "hidden_size": 6 * 32, "head_dim": 32,
            "max_position_embeddings": 2048, "torch_dtype": "float32"}


def mla_config():
    return {"model_type": "deepseek_v3", "num_hidden_layers": 1, "num_attention_heads": 4,
            "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 24,
            "rope_scaling": None, "max_position_embeddings": 2048, "torch_dtype": "float32"}


CONFIGS = {"gqa": gqa_config, "mla": mla_config}
ROWS = [3, 0, 5]  # the engine's request ids (any rows below max_requests)
TREE = [-1, 0, 0, 1, 1, 2]  # parents of a verify block of 6 (depths 0 1 1 2 2 2)


class Oracle:
    """One Runtime as an engine drives it: slots per step, a verify's accepted path copied down."""

    def __init__(self, cfg, **opts):
        self.rt = attnrt.Runtime(cfg, dtype=torch.float32, attention_backend="cpu", page_size=1,
                                 max_requests=8, kv_slots=4096, max_num_tokens=256, **opts)
        self.row = {r: self.rt.alloc_request() for r in ROWS}
        self.lens = {r: 0 for r in ROWS}

    def place(self, rows, counts):
        """Slots for `counts` new tokens of each request after its cached ones."""
        prefix = [self.lens[r] for r in rows]
        last = [int(self.rt.req_to_token[self.row[r], p - 1]) if p > 0 else -1
                for r, p in zip(rows, prefix)]
        slots = self.rt.alloc_extend(prefix, [p + n for p, n in zip(prefix, counts)], last)
        at = 0
        for r, p, n in zip(rows, prefix, counts):
            self.rt.write_req_to_token(self.row[r], p, slots[at:at + n])
            at += n
        return prefix, slots

    def batch(self, mode, rows, counts, spec=None):
        prefix, slots = self.place(rows, counts)
        engine_rows = [self.row[r] for r in rows]
        if mode == "DECODE":
            return attnrt.ForwardBatch("DECODE", engine_rows, [p + 1 for p in prefix], slots,
                                       positions=prefix), rows
        if mode == "TARGET_VERIFY":
            depth = [0] * len(TREE)
            for t in range(1, len(TREE)):
                depth[t] = depth[TREE[t]] + 1
            n = counts[0]
            d = depth if spec.topk > 1 else list(range(n))
            return attnrt.ForwardBatch("TARGET_VERIFY", engine_rows, prefix, slots,
                                       positions=[p + d[t] for p in prefix for t in range(n)],
                                       spec_info=spec), rows
        return attnrt.ForwardBatch("EXTEND", engine_rows, [p + n for p, n in zip(prefix, counts)],
                                   slots, extend_prefix_lens=prefix, extend_seq_lens=counts,
                                   positions=[p + t for p, n in zip(prefix, counts)
                                              for t in range(n)]), rows

    def keep(self, rows, block, kept, paths=None):
        """After a step: request rows[i] keeps kept[i] of its block[i] new tokens; a tree verify's
        accepted path (paths[i]) first has its nodes' K/V copied down to the columns after the
        prefix, as an engine compacts a tree path. The rest of the block is freed."""
        for i, r in enumerate(rows):
            row, p = self.row[r], self.lens[r]
            cols = self.rt.req_to_token[row]
            if paths is not None:
                for layer in self.rt.layers:
                    k, v, _, _ = self.rt.kv_buffers(layer)
                    for depth, node in enumerate(paths[i]):
                        src, dst = int(cols[p + node]), int(cols[p + depth])
                        k[dst] = k[src].clone()
                        if v.data_ptr() != k.data_ptr():
                            v[dst] = v[src].clone()
            if block[i] > kept[i]:
                self.rt.free_slots([int(x) for x in cols[p + kept[i]:p + block[i]]])
            self.lens[r] = p + kept[i]


def draw(layers, T, gen, device="cpu"):
    """q, k, v of every layer for T tokens (MLA: the absorbed form, v a view of the latent rows)."""
    out = []
    for info in layers.values():
        if info["kind"] == "mla":
            row = info["head_dim"]
            q = torch.randn(T, info["num_q_heads"], row, generator=gen)
            k = torch.randn(T, 1, row, generator=gen)
            out.append((q.to(device), k.to(device), k.to(device)[:, :, :info["v_head_dim"]]))
        else:
            h, kv, d = info["num_q_heads"], info["num_kv_heads"], info["head_dim"]
            out.append(tuple(x.to(device) for x in (torch.randn(T, h, d, generator=gen),
                                                    torch.randn(T, kv, d, generator=gen),
                                                    torch.randn(T, kv, d, generator=gen))))
    return out


def steps(oracle, tree=True):
    """The steps of the scenario as (mode, rows, new tokens per row, spec, accepted paths)."""
    chain = attnrt.SpecInfo(draft_token_num=4, topk=1)
    tree_spec = attnrt.SpecInfo(draft_token_num=len(TREE), topk=2, parents=TREE * 2)
    yield "EXTEND", ROWS, [37, 20, 3], None, None           # prompts of ragged lengths
    yield "EXTEND", ROWS[:2], [9, 17], None, None           # a chunk over the cached prefix
    yield "DECODE", ROWS, [1, 1, 1], None, None
    yield "TARGET_VERIFY", ROWS, [4, 4, 4], chain, [[0, 1], [0, 1, 2, 3], [0]]
    yield "DECODE", ROWS, [1, 1, 1], None, None
    if tree:
        yield "TARGET_VERIFY", ROWS[1:], [6, 6], tree_spec, [[0, 2, 5], [0, 1, 3]]
    yield "DECODE", ROWS, [1, 1, 1], None, None


def run_scenario(cfg, group_of, gen, device="cpu", tree=True, dtype=torch.float32):
    """Every step on the oracle and on the DCP side (group_of(batch, layer inputs) -> outputs);
    returns the largest difference per step. The DCP side gets its inputs in `dtype` (bf16 on cuda
    ranks), the oracle the same values in float32."""
    oracle = Oracle(cfg)
    diffs = []
    for mode, rows, counts, spec, paths in steps(oracle, tree):
        batch, _ = oracle.batch(mode, rows, counts, spec)
        T = sum(counts)
        inputs = draw(oracle.rt.layers, T, gen)
        if dtype != torch.float32:
            inputs = [tuple(x.to(dtype).float() for x in qkv) for qkv in inputs]
        want = []
        oracle.rt.begin_step(batch)
        for layer, (q, k, v) in zip(oracle.rt.layers, inputs):
            want.append(oracle.rt.forward(layer, q, k, v))
        oracle.rt.end_step()
        moved = [tuple(x.to(device=device, dtype=dtype) for x in qkv) for qkv in inputs]
        tree_paths = paths if spec is not None and spec.topk > 1 else None
        got = group_of(batch, moved, tree_paths)
        for w, g in zip(want, got):
            assert not torch.isnan(g).any(), f"{mode}: unwritten output elements"
            diffs.append((mode, (w - g.cpu().float()).abs().max().item()))
        if paths is None:
            oracle.keep(rows, counts, counts)
        else:  # a verify keeps its accepted tokens (a chain's: a prefix of its block)
            oracle.keep(rows, counts, [len(p) for p in paths], tree_paths)
    oracle.rt.close()
    return diffs


def group_runner(group, layers, device="cpu"):
    def run(batch, inputs, tree_paths):
        group.begin_step(batch)
        outs = []
        for layer, (q, k, v) in zip(layers, inputs):
            info = layers[layer]
            out = torch.full((q.shape[0], info["num_q_heads"], info["v_head_dim"]), float("nan"),
                             device=device, dtype=q.dtype)
            outs.append(group.forward(layer, q, k, v, out))
        group.end_step()
        if tree_paths is not None:
            group.commit_verify(tree_paths)
        return outs
    return run


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("ranks,page", [(2, 1), (3, 16)])
def test_group_equals_one_runtime(kind, ranks, page, seed):
    cfg = CONFIGS[kind]()
    gen = torch.Generator().manual_seed(seed)
    with attnrt.DcpAttention(cfg, dcp_size=ranks, dtype=torch.float32, attention_backend="cpu",
                             page_size=page, max_requests=8, max_num_tokens=256) as group:
        assert group.size == ranks
        diffs = run_scenario(cfg, group_runner(group, group.layers), gen)
    worst = max(d for _, d in diffs)
    assert worst < 2e-4, diffs


def test_ranks_on_threads_equal_the_group(seed):
    """A DcpRank per thread over an in-process group: each writes its heads' merged rows; together
    they are the simulated group's output, bit for bit."""
    cfg, ranks = gqa_config(), 2
    opts = dict(dtype=torch.float32, attention_backend="cpu", page_size=16, max_requests=8,
                max_num_tokens=256)
    comms = attnrt.in_process_group(ranks)
    assert [c.rank for c in comms] == [0, 1] and comms[0].size == ranks
    members = [attnrt.DcpRank(cfg, rank=r, dcp_size=ranks, communicator=comms[r], **opts)
               for r in range(ranks)]
    group = attnrt.DcpAttention(cfg, dcp_size=ranks, **opts)
    layers = group.layers
    heads = [m.head_range(0) for m in members]
    assert heads[0][0] == 0 and heads[-1][1] == layers[0]["num_q_heads"]
    assert all(heads[r][1] == heads[r + 1][0] for r in range(ranks - 1))
    pool = concurrent.futures.ThreadPoolExecutor(ranks)

    def on_ranks(batch, inputs, tree_paths):
        outs = [torch.full((inputs[0][0].shape[0], layers[l]["num_q_heads"],
                            layers[l]["v_head_dim"]), float("nan")) for l in layers]

        def one(member):
            member.begin_step(batch)
            for i, (q, k, v) in enumerate(inputs):
                member.forward(i, q, k, v, outs[i])
            member.end_step()
            if tree_paths is not None:
                member.commit_verify(tree_paths)

        for f in [pool.submit(one, m) for m in members]:
            f.result(timeout=120)
        return outs

    gen = torch.Generator().manual_seed(seed)
    run_group = group_runner(group, layers)

    def both(batch, inputs, tree_paths):
        a = on_ranks(batch, inputs, tree_paths)
        b = run_group(batch, inputs, tree_paths)
        for x, y in zip(a, b):
            assert torch.equal(x, y)
        return a

    run_scenario(cfg, both, gen)
    pool.shutdown()
    for m in members:
        m.close()
    group.close()


def test_errors_name_the_problem():
    dsa = {"model_type": "deepseek_v32", "num_hidden_layers": 1, "num_attention_heads": 4,
           "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 24,
           "index_topk": 8, "index_n_heads": 4, "index_head_dim": 32, "rope_scaling": None,
           "max_position_embeddings": 1024, "torch_dtype": "float32"}
    with pytest.raises(attnrt.Error, match="indexer|DSA"):
        attnrt.DcpAttention(dsa, dcp_size=2, attention_backend="cpu")
    with pytest.raises(attnrt.Error, match="dcp_size"):
        attnrt.DcpAttention(gqa_config(), dcp_size=0, attention_backend="cpu")
    with pytest.raises(TypeError, match="dcp_size"):
        attnrt.DcpAttention(gqa_config(), dcp_size="2")
    with pytest.raises(TypeError, match="unknown option 'page_sise'"):
        attnrt.DcpAttention(gqa_config(), dcp_size=2, page_sise=16)
    comms = attnrt.in_process_group(2)
    with pytest.raises(ValueError, match="rank=1 but the communicator is rank 0"):
        attnrt.DcpRank(gqa_config(), rank=1, dcp_size=2, communicator=comms[0])
    with pytest.raises(attnrt.Error, match="dcp_size = 3 but the communicator's group has 2"):
        attnrt.DcpRank(gqa_config(), rank=0, dcp_size=3, communicator=comms[0],
                       attention_backend="cpu")
    with pytest.raises(TypeError, match="communicator"):
        attnrt.DcpRank(gqa_config(), rank=0, dcp_size=2, communicator="nccl")
    with pytest.raises(attnrt.Error, match="size 0"):
        attnrt.in_process_group(0)
    group = attnrt.DcpAttention(gqa_config(), dcp_size=2, attention_backend="cpu", max_requests=4)
    with pytest.raises(attnrt.Error, match="commit_verify"):
        group.commit_verify([[0]])
    batch = attnrt.ForwardBatch("EXTEND", [9], [4], [0, 0, 0, 0], extend_prefix_lens=[0],
                                extend_seq_lens=[4], positions=[0, 1, 2, 3])
    with pytest.raises(attnrt.Error, match="req_pool_indices"):
        group.begin_step(batch)
    group.close()
    assert group.closed
    with pytest.raises(RuntimeError, match="closed"):
        group.begin_step(batch)
    if not GPU:
        with pytest.raises(attnrt.Error, match="NCCL cannot be used here"):
            attnrt.nccl_unique_id()


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("page", [1, 16])
def test_cuda_ranks_on_one_gpu_equal_one_runtime(page, seed):
    cfg = gqa_config()
    gen = torch.Generator().manual_seed(seed)
    with attnrt.DcpAttention(cfg, dcp_size=2, dtype=torch.bfloat16, attention_backend="cuda",
                             page_size=page, max_requests=8, max_num_tokens=256) as group:
        assert group.device.type == "cuda"
        # Tree verify needs page_size 1 on cuda ranks (docs/dcp.md); chains run at any page size.
        diffs = run_scenario(cfg, group_runner(group, group.layers, "cuda"), gen, "cuda",
                             tree=page == 1, dtype=torch.bfloat16)
    # bf16 outputs of values up to ~3: a few units in the 8th bit.
    assert max(d for _, d in diffs) < 3e-2, diffs


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("stream", [False, True])
def test_one_rank_over_nccl(stream, seed):
    """A group of one GPU over NCCL (this machine's): the NCCL path end to end, on the legacy
    default stream and under torch.cuda.stream(s) (the collectives then go to s)."""
    cfg = gqa_config()
    comm = attnrt.nccl_communicator(attnrt.nccl_unique_id(), 1, 0)
    with attnrt.DcpRank(cfg, rank=0, dcp_size=1, communicator=comm, dtype=torch.bfloat16,
                        attention_backend="cuda", page_size=1, max_requests=8,
                        max_num_tokens=256) as rank:
        assert rank.head_range(0) == (0, 6)
        runner = group_runner(rank, rank.layers, "cuda")
        if stream:
            runner = on_stream(runner, torch.cuda.Stream())
        diffs = run_scenario(cfg, runner, torch.Generator().manual_seed(seed), "cuda",
                             dtype=torch.bfloat16)
    assert max(d for _, d in diffs) < 3e-2, diffs


# ---- torch's current stream (docs/python.md "Decode context parallelism") ----------------------
def on_stream(runner, stream):
    """`runner` with the step on `stream` (non-blocking, as torch makes them): a GPU sleep, then
    the inputs copied there by a kernel, so ranks that read them out of that stream's order would
    see them unwritten; the outputs are handed back in order with torch's default stream."""
    def run(batch, inputs, tree_paths):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)
            mine = []
            for q, k, v in inputs:
                k2 = k.clone()
                v2 = k2[:, :, :v.shape[2]] if v.data_ptr() == k.data_ptr() else v.clone()
                mine.append((q.clone(), k2, v2))
            outs = runner(batch, mine, tree_paths)
        torch.cuda.current_stream().wait_stream(stream)
        return outs
    return run


nccl_why = attnrt.dcp._native.nccl_unavailable_reason() if GPU else "needs a CUDA device"


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_cuda_ranks_on_torchs_stream_equal_the_legacy_stream(seed):
    """The group under torch.cuda.stream(s) gives the bits of the group on the legacy default
    stream, step after step (tree verify and its commit included), with every rank on s."""
    cfg = gqa_config()
    opts = dict(dtype=torch.bfloat16, attention_backend="cuda", page_size=1, max_requests=8,
                max_num_tokens=256, deterministic=True)
    legacy = attnrt.DcpAttention(cfg, dcp_size=2, **opts)
    streamed = attnrt.DcpAttention(cfg, dcp_size=2, **opts)
    s = torch.cuda.Stream()
    run_legacy = group_runner(legacy, legacy.layers, "cuda")
    run_streamed = on_stream(group_runner(streamed, streamed.layers, "cuda"), s)

    def both(batch, inputs, tree_paths):
        a = run_legacy(batch, inputs, tree_paths)
        b = run_streamed(batch, inputs, tree_paths)
        assert streamed._g.stream() == s.cuda_stream and legacy._g.stream() == 0
        for x, y in zip(a, b):
            assert torch.equal(x, y), "the group on torch's stream differs from the legacy one"
        return b

    diffs = run_scenario(cfg, both, torch.Generator().manual_seed(seed), "cuda",
                         dtype=torch.bfloat16)
    assert max(d for _, d in diffs) < 3e-2, diffs
    legacy.close()
    streamed.close()


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["group", "nccl_rank"])
def test_cuda_dcp_step_on_torchs_stream_does_not_wait_for_the_gpu(kind):
    """A step (begin_step, forward, end_step) queued behind a long GPU sleep on torch's current
    stream returns while the sleep still runs: nothing in it waits for the GPU."""
    if kind == "nccl_rank" and nccl_why:
        pytest.skip(f"NCCL: {nccl_why}")
    cfg = gqa_config()
    opts = dict(dtype=torch.bfloat16, attention_backend="cuda", page_size=16, max_requests=8,
                max_num_tokens=256)
    if kind == "group":
        g = attnrt.DcpAttention(cfg, dcp_size=2, **opts)
    else:
        comm = attnrt.nccl_communicator(attnrt.nccl_unique_id(), 1, 0)
        g = attnrt.DcpRank(cfg, rank=0, dcp_size=1, communicator=comm, **opts)
    oracle = Oracle(cfg)
    gen = torch.Generator().manual_seed(11)
    s = torch.cuda.Stream()

    def step(mode, counts, sleep=False):
        batch, _ = oracle.batch(mode, ROWS, counts)
        inputs = draw(g.layers, sum(counts), gen, "cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            if sleep:
                torch.cuda._sleep(200_000_000)  # the GPU is busy for a while on this stream
            busy = torch.cuda.Event()
            busy.record(s)
            t0 = time.perf_counter()
            g.begin_step(batch)
            outs = [g.forward(l, *[x.to(torch.bfloat16) for x in qkv])
                    for l, qkv in zip(g.layers, inputs)]
            g.end_step()
            host = time.perf_counter() - t0
            running = not busy.query()
            assert g._g.stream() == s.cuda_stream, "the ranks are not on torch's current stream"
            done = [o.clone() for o in outs]  # after the ranks' kernels on the same stream
        s.synchronize()
        oracle.keep(ROWS, counts, counts)
        assert not any(torch.isnan(d).any() for d in done)
        return running, host

    step("EXTEND", [37, 20, 3])
    step("DECODE", [1, 1, 1])  # every kernel of a decode step loaded before the one timed
    running, host = step("DECODE", [1, 1, 1], sleep=True)
    assert running and host < 0.05, \
        f"the decode step took {host * 1e3:.1f} ms on the host and the GPU sleep before it " \
        f"{'still ran' if running else 'had ended'}: it synchronised"
    g.close()
    oracle.rt.close()


# ---- CUDA graphs the engine captures (docs/dcp.md "CUDA graphs") ------------------------------
def graph_runner(group, layers, rows, eager_runner):
    """Steps of at most `rows` tokens replayed from one torch.cuda.graph of the group (captured
    at the first such step: every layer's forward over static tensors of `rows` rows), the others
    (long prompts) run by `eager_runner`. Each replay gets its inputs copied into the static
    tensors and its outputs poisoned first; the rows past the step's tokens must come out 0."""
    static, graphs = {}, []

    def capture(inputs):
        group.init_cuda_graph_state(rows)
        for layer, (q, k, v) in zip(layers, inputs):
            info = layers[layer]
            sq = torch.zeros((rows, *q.shape[1:]), device="cuda", dtype=q.dtype)
            sk = torch.zeros((rows, *k.shape[1:]), device="cuda", dtype=k.dtype)
            sv = sk[:, :, :v.shape[2]] if v.data_ptr() == k.data_ptr() else \
                torch.zeros((rows, *v.shape[1:]), device="cuda", dtype=v.dtype)
            out = torch.zeros((rows, info["num_q_heads"], info["v_head_dim"]), device="cuda",
                              dtype=q.dtype)
            static[layer] = (sq, sk, sv, out)
        group.begin_capture_step(rows)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for layer, (sq, sk, sv, out) in static.items():
                group.forward(layer, sq, sk, sv, out)
        group.end_step()
        graphs.append(g)

    def run(batch, inputs, tree_paths):
        T = inputs[0][0].shape[0]
        if T > rows:
            return eager_runner(batch, inputs, tree_paths)
        if not graphs:
            capture(inputs)
        for layer, (q, k, v) in zip(layers, inputs):
            sq, sk, sv, out = static[layer]
            sq.normal_()  # the rows past T: leftovers nothing may read
            sk.normal_()
            sq[:T] = q
            sk[:T] = k
            if sv.data_ptr() != sk.data_ptr():
                sv.normal_()
                sv[:T] = v
            out.fill_(float("nan"))
        group.begin_replay_step(batch, rows)
        graphs[0].replay()
        group.end_step()
        if tree_paths is not None:
            group.commit_verify(tree_paths)
        outs = []
        for layer in layers:
            out = static[layer][3]
            assert torch.equal(out[T:], torch.zeros_like(out[T:])), \
                "rows past the step's tokens are not 0"
            outs.append(out[:T].clone())
        return outs
    return run


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_torch_cuda_graph_of_dcp_steps_replays_like_the_eager_group(kind, seed):
    """torch.cuda.graph captures a step of 16 rows of a group of 2 cuda ranks (every layer's
    forward on the capture's stream, torch's current one); the scenario's steps of at most 16
    tokens (decodes, a chain verify, a tree verify with its commit) replay it with their inputs in
    the static tensors. Outputs equal the eager group's and the oracle's (one Runtime)."""
    cfg = CONFIGS[kind]()
    opts = dict(dtype=torch.bfloat16, attention_backend="cuda", page_size=1, max_requests=8,
                max_num_tokens=256)
    eager = attnrt.DcpAttention(cfg, dcp_size=2, cuda_graphs=False, **opts)
    graphed = attnrt.DcpAttention(cfg, dcp_size=2, **opts)
    assert graphed.cuda_graphs_off_reason == "", graphed.cuda_graphs_off_reason
    assert "cuda_graphs is false" in eager.cuda_graphs_off_reason
    run_eager = group_runner(eager, eager.layers, "cuda")
    run_graphed = graph_runner(graphed, graphed.layers, 16,
                               group_runner(graphed, graphed.layers, "cuda"))
    replayed = []

    def both(batch, inputs, tree_paths):
        a = run_eager(batch, inputs, tree_paths)
        b = run_graphed(batch, inputs, tree_paths)
        if inputs[0][0].shape[0] <= 16:
            replayed.append(batch)
        for x, y in zip(a, b):
            err = (x.float() - y.float()).abs().max().item()
            assert err < 3e-2, f"the replayed group differs from the eager one by {err}"
        return b

    diffs = run_scenario(cfg, both, torch.Generator().manual_seed(seed), "cuda",
                         dtype=torch.bfloat16)
    assert len(replayed) >= 5, "the scenario's decodes and verifies did not replay the graph"
    assert max(d for _, d in diffs) < 3e-2, diffs
    with pytest.raises(attnrt.Error, match="more than the 16 rows of the graph"):
        batch = attnrt.ForwardBatch("EXTEND", [0], [17], [0] * 17, extend_prefix_lens=[0],
                                    extend_seq_lens=[17], positions=list(range(17)))
        graphed.begin_replay_step(batch, 16)
    eager.close()
    graphed.close()


def test_graph_steps_on_host_ranks_say_why_not():
    group = attnrt.DcpAttention(gqa_config(), dcp_size=2, attention_backend="cpu", max_requests=4)
    assert "on the host" in group.cuda_graphs_off_reason
    with pytest.raises(attnrt.Error, match="CUDA graphs are off"):
        group.init_cuda_graph_state(8)
    with pytest.raises(attnrt.Error, match="CUDA graphs are off"):
        group.begin_capture_step(8)
    group.close()
