"""DSA (DeepSeek V3.2's sparse attention, docs/dsa.md) from Python: a small deepseek_v32 config with
an indexer, a prefill longer than index_topk, then a decode, on the cpu backend (and the cuda
backend, with every tensor on the GPU) against the reference backend: the same selections
(index_topk output) and outputs. Also the options and the errors of misused indexer inputs.

Inputs are drawn fresh from a seed printed with every failure (ATTNRT_TEST_SEED replays one)."""
import pytest

torch = pytest.importorskip("torch")
attnrt = pytest.importorskip("attnrt")

HEADS, RANK, ROPE, NOPE, V = 4, 64, 16, 32, 24
ROW = RANK + ROPE
TOPK, IH, ID = 8, 4, 32


def dsa_config():
    return {"model_type": "deepseek_v32", "num_hidden_layers": 1, "num_attention_heads": HEADS,
            "kv_lora_rank": RANK, "qk_rope_head_dim": ROPE, "qk_nope_head_dim": NOPE,
            "v_head_dim": V, "index_topk": TOPK, "index_n_heads": IH, "index_head_dim": ID,
            "rope_scaling": None, "max_position_embeddings": 1024, "torch_dtype": "float32"}


def run(backend, steps, device="cpu", dtype=torch.float32):
    """The two steps on `backend`: q and the latent rows in `dtype` on `device`, the indexer's
    inputs in float32 there; returns (out, index_topk) per step, on the host, out in float32."""
    rt = attnrt.Runtime(dsa_config(), dtype=dtype, attention_backend=backend,
                        page_size=16, max_requests=4, kv_slots=512, max_num_tokens=64)
    info = rt.layers[0]
    assert (info["index_topk"], info["index_n_heads"], info["index_head_dim"]) == (TOPK, IH, ID)
    lens = [20, 13]
    rows = [rt.alloc_request() for _ in lens]
    slots = [rt.alloc_extend([0], [n + 1], [-1]) for n in lens]
    for r, s in zip(rows, slots):
        rt.write_req_to_token(r, 0, s)
    results = []
    # Step 1: the prompts (EXTEND without a prefix); step 2: one decode token each.
    batches = [
        attnrt.ForwardBatch("EXTEND", rows, lens, [x for s, n in zip(slots, lens) for x in s[:n]],
                            extend_prefix_lens=[0, 0], extend_seq_lens=lens,
                            positions=[t for n in lens for t in range(n)]),
        attnrt.ForwardBatch("DECODE", rows, [n + 1 for n in lens], [s[n] for s, n in zip(slots, lens)],
                            positions=list(lens)),
    ]
    for batch, inputs in zip(batches, steps):
        results.append(step(rt, batch, inputs, device, dtype))
    rt.close()
    return results


def step(rt, batch, inputs, device, dtype):
    """One step of the layer: q and the latent rows in `dtype` on `device`, the indexer's inputs in
    float32 there, outputs poisoned first; returns (out, index_topk) on the host, out in float32."""
    q, lat, iq, ik, iw = inputs
    T = q.shape[0]
    q, lat = q.to(device=device, dtype=dtype), lat.to(device=device, dtype=dtype)
    iq, ik, iw = (x.to(device) for x in (iq, ik, iw))
    out = torch.full((T, HEADS, RANK), float("nan"), device=device, dtype=dtype)
    topk = torch.full((T, TOPK), -7, dtype=torch.int32, device=device)
    rt.begin_step(batch)
    rt.forward(0, q, lat, lat[:, :, :RANK], out, index_q=iq, index_k=ik, index_weights=iw,
               index_topk=topk)
    rt.end_step()
    return out.float().cpu(), topk.cpu()


def draw(gen, T):
    return (torch.randn(T, HEADS, ROW, generator=gen), torch.randn(T, 1, ROW, generator=gen),
            torch.randn(T, IH, ID, generator=gen), torch.randn(T, ID, generator=gen),
            torch.rand(T, IH, generator=gen))


def test_cpu_matches_reference_selection_and_output(seed):
    gen = torch.Generator().manual_seed(seed)
    steps = [draw(gen, 33), draw(gen, 2)]
    want = run("reference", steps)
    got = run("cpu", steps)
    for (o, k), (wo, wk) in zip(got, want):
        assert torch.equal(k, wk)
        torch.testing.assert_close(o, wo, rtol=2e-4, atol=2e-4)
    # A prompt token t selects min(t + 1, TOPK) tokens: every one of them when it has fewer.
    k = want[0][1]
    assert (k[0, 1:] == -1).all() and k[0, 0] == 0
    assert (k[19] >= 0).all() and (k[19] <= 19).all()


def draw_exact(gen, T):
    """Indexer inputs whose scores every backend computes exactly: small integers (exact in e4m3
    at any power-of-two scale the rounding picks), weights of 1/4 steps; so the selections must
    agree key for key, ties (frequent here) broken by the lower token index everywhere. q and the
    latent rows are bf16-exact."""
    def ints(*shape, lo=-7, hi=8):
        return torch.randint(lo, hi, shape, generator=gen).float()
    q, lat = (x.to(torch.bfloat16).float() for x in (torch.randn(T, HEADS, ROW, generator=gen),
                                                    torch.randn(T, 1, ROW, generator=gen)))
    return q, lat, ints(T, IH, ID), ints(T, ID), ints(T, IH, lo=1, hi=9) / 4


def check_exact(backend, device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    steps = [draw_exact(gen, 33), draw_exact(gen, 2)]
    want = run("reference", steps)
    got = run(backend, steps, device, dtype)
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    for i, ((o, k), (wo, wk)) in enumerate(zip(got, want)):
        assert torch.equal(k, wk), f"step {i}: selections differ\n{k}\n{wk}"
        torch.testing.assert_close(o, wo, rtol=tol, atol=tol)


def test_cpu_exact_scores_select_as_reference(seed):
    check_exact("cpu", "cpu", torch.float32, seed)


@pytest.mark.skipif(not (attnrt.cuda_status()[0] and torch.cuda.is_available()),
                    reason="needs a CUDA device")
def test_cuda_exact_scores_select_as_reference(seed):
    """The cuda backend from Python (bf16 pools, every tensor on the GPU, index_topk written on the
    device): the same selections as reference, outputs within the bf16 tolerance."""
    check_exact("cuda", "cuda", torch.bfloat16, seed)


@pytest.mark.skipif(not (attnrt.cuda_status()[0] and torch.cuda.is_available()),
                    reason="needs a CUDA device")
def test_torch_cuda_graph_of_a_dsa_decode_replays_like_the_eager_step(seed):
    """An engine captures a DSA layer's DECODE step with torch.cuda.graph (the indexer's inputs
    and index_topk as static tensors) and replays it at 3 and 2 of 4 requests: the selections equal
    the eager step's and reference's, key for key (exact-score inputs), outputs within bf16."""
    gen = torch.Generator().manual_seed(seed)
    opts = dict(page_size=16, max_requests=8, kv_slots=1024, max_num_tokens=128)
    rt = attnrt.Runtime(dsa_config(), dtype=torch.bfloat16, attention_backend="cuda", **opts)
    ref = attnrt.Runtime(dsa_config(), dtype=torch.float32, attention_backend="reference", **opts)
    assert rt.cuda_graphs_off_reason == "", rt.cuda_graphs_off_reason
    lens = [20, 13, 31]
    rows = {}
    for r_ in (rt, ref):
        rows[r_] = [r_.alloc_request() for _ in lens]
        for row, n in zip(rows[r_], lens):
            r_.write_req_to_token(row, 0, r_.alloc_extend([0], [n + 2], [-1]))

    def batch_of(r_, mode, real, k):
        rs = rows[r_][:real]
        if mode == "EXTEND":
            slots = [int(r_.req_to_token[row, t]) for row, n in zip(rs, lens) for t in range(n)]
            return attnrt.ForwardBatch("EXTEND", rs, lens, slots, extend_prefix_lens=[0] * real,
                                       extend_seq_lens=lens,
                                       positions=[t for n in lens for t in range(n)])
        seq = [n + 1 + k for n in lens[:real]]
        slots = [int(r_.req_to_token[row, s - 1]) for row, s in zip(rs, seq)]
        return attnrt.ForwardBatch("DECODE", rs, seq, slots, positions=[s - 1 for s in seq])

    prompt = draw_exact(gen, sum(lens))
    step(rt, batch_of(rt, "EXTEND", 3, 0), prompt, "cuda", torch.bfloat16)
    step(ref, batch_of(ref, "EXTEND", 3, 0), prompt, "cpu", torch.float32)

    bs = 4
    rt.init_cuda_graph_state(bs, bs)
    dev = dict(device="cuda")
    sq = torch.zeros(bs, HEADS, ROW, dtype=torch.bfloat16, **dev)
    slat = torch.zeros(bs, 1, ROW, dtype=torch.bfloat16, **dev)
    siq, sik, siw = (torch.zeros(bs, IH, ID, **dev), torch.zeros(bs, ID, **dev),
                     torch.zeros(bs, IH, **dev))
    sout = torch.zeros(bs, HEADS, RANK, dtype=torch.bfloat16, **dev)
    stopk = torch.zeros(bs, TOPK, dtype=torch.int32, **dev)
    rt.begin_capture_step(attnrt.ForwardBatch("DECODE", [], [], []), bs)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        rt.forward(0, sq, slat, slat[:, :, :RANK], sout, index_q=siq, index_k=sik,
                   index_weights=siw, index_topk=stopk)
    rt.end_step()
    for k, real in enumerate((3, 2)):
        inputs = draw_exact(gen, real)
        for static, x in zip((sq, slat, siq, sik, siw), inputs):
            static.zero_()
            static[:real] = x.to(device="cuda", dtype=static.dtype)
        sout.fill_(float("nan"))
        stopk.fill_(-7)
        rt.begin_replay_step(batch_of(rt, "DECODE", real, k), bs)
        g.replay()
        rt.end_step()
        graph_out, graph_topk = sout[:real].float().cpu(), stopk[:real].cpu()
        # The same step eagerly (its K/V and index keys stored again at the same slots).
        out, topk = step(rt, batch_of(rt, "DECODE", real, k), inputs, "cuda", torch.bfloat16)
        want_out, want_topk = step(ref, batch_of(ref, "DECODE", real, k), inputs, "cpu",
                                    torch.float32)
        assert torch.equal(graph_topk, topk), f"replay at {real}: graph and eager select apart"
        assert torch.equal(graph_topk, want_topk), f"replay at {real}: cuda and reference apart"
        # (Graph and eager steps may split the sparse attention differently: bf16 rounding apart.)
        torch.testing.assert_close(graph_out, out, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(graph_out, want_out, rtol=3e-2, atol=3e-2)
    for r_ in (rt, ref):
        r_.close()


def test_indexer_inputs_are_checked():
    # The dsa router with its phases' sub-backends named (the reference engine's option names).
    rt = attnrt.Runtime(dsa_config(), dtype=torch.float32, attention_backend="dsa", page_size=16,
                        max_requests=2, kv_slots=128, dsa_prefill_backend="cpu",
                        dsa_decode_backend="cpu")
    row = rt.alloc_request()
    s = rt.alloc_extend([0], [4], [-1])
    rt.write_req_to_token(row, 0, s)
    rt.begin_step(attnrt.ForwardBatch("EXTEND", [row], [4], s, extend_prefix_lens=[0],
                                      extend_seq_lens=[4], positions=list(range(4))))
    q, lat = torch.randn(4, HEADS, ROW), torch.randn(4, 1, ROW)
    with pytest.raises(attnrt.Error, match="index"):
        rt.forward(0, q, lat, lat[:, :, :RANK], torch.empty(4, HEADS, RANK))
    with pytest.raises(attnrt.Error, match="index"):
        rt.forward(0, q, lat, lat[:, :, :RANK], torch.empty(4, HEADS, RANK),
                   index_q=torch.randn(4, IH, ID + 1), index_k=torch.randn(4, ID),
                   index_weights=torch.rand(4, IH))
    rt.end_step()
    rt.close()
