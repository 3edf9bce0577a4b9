"""MLA in the MHA form from Python (docs/mla.md): a small DeepSeek-V2-style MLA layer on the cpu
backend, an EXTEND step on cached prefixes read in two chunks (forward_mla_mha, then per chunk
gather_prefix_chunk and forward_mla_prefix_chunk), against the absorbed form computed from the same
latent rows with the same random W_UK / W_UV: by attnrt's own absorbed forward in the same step and
by float64 torch.

Inputs are drawn fresh from a seed printed with every failure (ATTNRT_TEST_SEED replays one)."""
import pytest

torch = pytest.importorskip("torch")
attnrt = pytest.importorskip("attnrt")

HEADS, RANK, ROPE, NOPE, V = 4, 64, 16, 32, 24
ROW = RANK + ROPE


def mla_config():
    return {"model_type": "deepseek_v2", "num_hidden_layers": 1, "num_attention_heads": HEADS,
            "kv_lora_rank": RANK, "qk_rope_head_dim": ROPE, "qk_nope_head_dim": NOPE,
            "v_head_dim": V, "rope_scaling": None, "max_position_embeddings": 1024,
            "torch_dtype": "float32"}


class Weights:
    """W_UK [H, R, N] and W_UV [H, R, Dv] (the model's kv_b_proj split per head) and the maps of
    both forms."""

    def __init__(self, gen):
        self.uk = torch.randn(HEADS, RANK, NOPE, generator=gen) / RANK ** 0.5
        self.uv = torch.randn(HEADS, RANK, V, generator=gen) / RANK ** 0.5

    def decompress(self, latent):
        """latent [n, 1, R + P] -> k [n, H, N + P], v [n, H, Dv]."""
        c, rope = latent[:, 0, :RANK], latent[:, 0, RANK:]
        k_nope = torch.einsum("nr,hrd->nhd", c, self.uk.to(c.dtype))
        k = torch.cat([k_nope, rope[:, None, :].expand(-1, HEADS, -1)], dim=-1)
        return k.contiguous(), torch.einsum("nr,hrd->nhd", c, self.uv.to(c.dtype)).contiguous()

    def absorb_q(self, q):
        """q [T, H, N + P] -> q_lat [T, H, R + P] = [W_UK q_nope | q_rope]."""
        q_lat = torch.einsum("thd,hrd->thr", q[..., :NOPE], self.uk.to(q.dtype))
        return torch.cat([q_lat, q[..., NOPE:]], dim=-1).contiguous()

    def project_out(self, out_lat):
        """out_lat [T, H, R] -> out [T, H, Dv] = W_UV^T out_lat."""
        return torch.einsum("thr,hrd->thd", out_lat, self.uv.to(out_lat.dtype))


def extend_batch(rows, prefix, extend, new_slots):
    """The EXTEND step of those requests: extend[i] new tokens after prefix[i] cached ones."""
    positions = [p + t for p, e in zip(prefix, extend) for t in range(e)]
    return attnrt.ForwardBatch("EXTEND", rows, [p + e for p, e in zip(prefix, extend)], new_slots,
                               extend_prefix_lens=prefix, extend_seq_lens=extend,
                               positions=positions)


def place_requests(rt, pool, prefix, extend, rows_of):
    """One request per (prefix, extend): its slots allocated and written to req_to_token, its
    prefix rows in the latent pool from rows_of(prefix). Returns (rows, slots, the step's new
    slots)."""
    rows, slots, new_slots = [], [], []
    for p, e in zip(prefix, extend):
        row = rt.alloc_request()
        s = rt.alloc_extend([0], [p + e], [-1])
        rt.write_req_to_token(row, 0, s)
        pool[torch.tensor(s[:p], device=pool.device)] = rows_of(p)
        rows.append(row)
        slots.append(s)
        new_slots += s[p:]
    return rows, slots, new_slots


def test_mha_form_with_two_chunks_equals_the_absorbed_form(seed):
    gen = torch.Generator().manual_seed(seed)
    prefix, extend = [40, 23], [6, 9]
    # chunk_len = capacity / requests = 20: prefix positions 0..19, then 20..39.
    rt = attnrt.Runtime(mla_config(), dtype=torch.float32, attention_backend="cpu", page_size=16,
                        max_requests=4, kv_slots=512, max_num_tokens=64,
                        chunked_prefix_cache_threshold=1, max_chunk_capacity=40)
    info = rt.layers[0]
    assert info["kind"] == "mla"
    assert (info["qk_nope_head_dim"], info["mha_v_head_dim"], info["head_dim"]) == (NOPE, V, ROW)
    scale = info["scaling"]
    assert scale == pytest.approx((NOPE + ROPE) ** -0.5)

    # Requests whose prefixes are already in the latent pool (random rows written in place).
    pool = rt.kv_buffers(0)[0]  # [rows, 1, R + P], zero-copy
    rows, slots, new_slots = place_requests(
        rt, pool, prefix, extend, lambda p: torch.randn(p, 1, ROW, generator=gen))
    T = sum(extend)
    rt.begin_step(extend_batch(rows, prefix, extend, new_slots))
    assert rt.mla_form() == "mha"
    plan = rt.prefix_chunk_plan()
    assert plan["chunk_len"] == 20
    assert [c["lens"] for c in plan["chunks"]] == [[20, 20], [20, 3]]
    assert plan["chunks"][1]["slots"] == slots[0][20:40] + slots[1][20:23]

    w = Weights(gen)
    q = torch.randn(T, HEADS, NOPE + ROPE, generator=gen)
    latent = torch.randn(T, 1, ROW, generator=gen)
    k, v = w.decompress(latent)
    with pytest.raises(attnrt.Error, match="before the causal part"):
        rt.forward_mla_prefix_chunk(0, 0, q, k, v, torch.empty(T, HEADS, V),
                                    torch.empty(T, HEADS))
    out, lse = rt.forward_mla_mha(0, q, k, v, latent)
    assert out.shape == (T, HEADS, V) and lse.shape == (T, HEADS)
    for c, chunk in enumerate(plan["chunks"]):
        lat = rt.gather_prefix_chunk(0, c)
        assert lat.shape == (chunk["num_tokens"], 1, ROW)
        assert torch.equal(lat, pool[torch.tensor(chunk["slots"])])
        k_c, v_c = w.decompress(lat)
        assert rt.forward_mla_prefix_chunk(0, c, q, k_c, v_c, out, lse) is out
    # The step's latent rows were stored at out_cache_loc.
    assert torch.equal(pool[torch.tensor(new_slots)], latent)

    # The absorbed form of the same step, by attnrt (the absorbed plan is always made) ...
    q_lat = w.absorb_q(q)
    out_lat = torch.empty(T, HEADS, RANK)
    lse_abs = torch.empty(T, HEADS)
    rt.forward(0, q_lat, latent, latent[:, :, :RANK], out_lat, save_kv=False, lse=lse_abs)
    rt.end_step()
    torch.testing.assert_close(out, w.project_out(out_lat), rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(lse, lse_abs, rtol=2e-4, atol=2e-4)

    # ... and by float64 torch over the pool rows each query sees (its prefix, its extend 0..t).
    i = 0
    for r, (p, e) in enumerate(zip(prefix, extend)):
        keys = pool[torch.tensor(slots[r])][:, 0].double()  # [p + e, R + P]
        for t in range(e):
            ql = w.absorb_q(q[i:i + 1].double())[0]  # [H, R + P]
            scores = scale * ql @ keys[:p + t + 1].T  # [H, keys]
            probs = torch.softmax(scores, dim=-1)
            want = w.project_out((probs @ keys[:p + t + 1, :RANK])[None])[0]
            torch.testing.assert_close(out[i].double(), want, rtol=2e-4, atol=2e-4)
            torch.testing.assert_close(lse[i].double(), torch.logsumexp(scores, dim=-1),
                                       rtol=2e-4, atol=2e-4)
            i += 1
    rt.close()


def test_mha_form_calls_refuse_an_absorbed_step():
    # The default threshold (8192 prefix tokens) keeps a short extend absorbed.
    rt = attnrt.Runtime(mla_config(), dtype=torch.float32, attention_backend="cpu", page_size=16,
                        max_requests=2, kv_slots=128)
    row = rt.alloc_request()
    s = rt.alloc_extend([0], [12], [-1])
    rt.write_req_to_token(row, 0, s)
    rt.begin_step(attnrt.ForwardBatch("EXTEND", [row], [12], s[8:], extend_prefix_lens=[8],
                                      extend_seq_lens=[4], positions=list(range(8, 12))))
    assert rt.mla_form() == "absorbed"
    assert rt.prefix_chunk_plan()["chunks"] == []
    q, k = torch.randn(4, HEADS, NOPE + ROPE), torch.randn(4, HEADS, NOPE + ROPE)
    with pytest.raises(attnrt.Error, match="absorbed form"):
        rt.forward_mla_mha(0, q, k, torch.randn(4, HEADS, V), torch.randn(4, 1, ROW))
    rt.end_step()
    rt.close()


CUDA_OK, CUDA_WHY = attnrt.cuda_status()


@pytest.mark.skipif(not (CUDA_OK and torch.cuda.is_available()),
                    reason=f"no usable CUDA device: {CUDA_WHY}")
def test_mha_form_on_cuda_uses_the_tensors_in_place(seed):
    """DeepSeek-V3's dims on the cuda backend with torch CUDA tensors: out / lse written in place
    (their own data_ptr), the latent rows gathered into a CUDA tensor, three chunks, against
    float64 torch over the pool rows each query sees."""
    heads, rank, rope, nope, vd = 16, 512, 64, 128, 128
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 1, "num_attention_heads": heads,
           "kv_lora_rank": rank, "qk_rope_head_dim": rope, "qk_nope_head_dim": nope,
           "v_head_dim": vd, "rope_scaling": None, "max_position_embeddings": 4096,
           "torch_dtype": "bfloat16"}
    gen = torch.Generator(device="cuda").manual_seed(seed)
    prefix, extend = [300, 77], [150, 9]
    rt = attnrt.Runtime(cfg, dtype=torch.bfloat16, attention_backend="cuda", page_size=64,
                        max_requests=4, kv_slots=2048, max_num_tokens=512, cuda_graphs=False,
                        chunked_prefix_cache_threshold=1, max_chunk_capacity=256)
    pool = rt.kv_buffers(0)[0]
    assert pool.is_cuda
    rows, slots, new_slots = place_requests(
        rt, pool, prefix, extend,
        lambda p: torch.randn(p, 1, rank + rope, generator=gen, device="cuda").to(torch.bfloat16))
    T = sum(extend)
    rt.begin_step(extend_batch(rows, prefix, extend, new_slots))
    assert rt.mla_form() == "mha"
    plan = rt.prefix_chunk_plan()
    assert len(plan["chunks"]) == 3  # 128 prefix positions per request per chunk
    uk = (torch.randn(heads, rank, nope, generator=gen, device="cuda") / rank ** 0.5)
    uv = (torch.randn(heads, rank, vd, generator=gen, device="cuda") / rank ** 0.5)

    def decompress(lat):
        c, r = lat[:, 0, :rank].float(), lat[:, 0, rank:].float()
        k = torch.cat([torch.einsum("nr,hrd->nhd", c, uk), r[:, None].expand(-1, heads, -1)], -1)
        return (k.to(torch.bfloat16).contiguous(),
                torch.einsum("nr,hrd->nhd", c, uv).to(torch.bfloat16).contiguous())

    q = torch.randn(T, heads, nope + rope, generator=gen, device="cuda").to(torch.bfloat16)
    latent = torch.randn(T, 1, rank + rope, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = decompress(latent)
    out = torch.full((T, heads, vd), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((T, heads), float("nan"), device="cuda")
    o2, l2 = rt.forward_mla_mha(0, q, k, v, latent, out, lse)
    assert o2.data_ptr() == out.data_ptr() and l2.data_ptr() == lse.data_ptr()
    for c, chunk in enumerate(plan["chunks"]):
        lat = rt.gather_prefix_chunk(0, c)
        assert lat.is_cuda and lat.shape == (chunk["num_tokens"], 1, rank + rope)
        assert torch.equal(lat, pool[torch.tensor(chunk["slots"], device="cuda")])
        k_c, v_c = decompress(lat)
        rt.forward_mla_prefix_chunk(0, c, q, k_c, v_c, out, lse)
    rt.end_step()
    torch.cuda.synchronize()
    assert torch.equal(pool[torch.tensor(new_slots, device="cuda")], latent)

    # float64: each query against its request's decompressed prefix and extend tokens 0..t.
    scale = rt.layers[0]["scaling"]
    i = 0
    for r, (p, e) in enumerate(zip(prefix, extend)):
        keys_lat = pool[torch.tensor(slots[r], device="cuda")]
        kk, vv = decompress(keys_lat)
        kk, vv = kk.double(), vv.double()
        for t in range(e):
            s = scale * torch.einsum("hd,nhd->hn", q[i].double(), kk[:p + t + 1])
            want = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vv[:p + t + 1])
            torch.testing.assert_close(out[i].double(), want, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(lse[i].double(), torch.logsumexp(s, -1), rtol=1e-3,
                                       atol=1e-3)
            i += 1
    rt.close()
