"""Loaders on the shipped real files and on small broken files."""
import gzip
import json

import numpy as np
import pytest

from tkcc.errors import TraceFormatError
from tkcc.traffic import Routing, Trace, bundled_trace, detect_format, iter_trace, load_trace, write_trace
from tkcc.traffic.stats import nearest_rank, trace_stats

AZ_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _pcts(x):
    return [nearest_rank(x, q) for q in (0.5, 0.9, 0.99)]


# published in ../shared/traces/README.md (nearest rank)
@pytest.mark.parametrize("name,n,inp,out,mean_in,mean_out,span", [
    ("azure-code", 8819, [1469, 5194, 7436], [13, 55, 252], 2048, 27.9, 3436),
    ("azure-conv", 19366, [1020, 2735, 4142], [129, 424, 601], 1155, 211, 3502),
    ("sharegpt", 30731, [1730, 5696, 7434], [415, 834, 998], 2340, 439, None),
])
def test_published_percentiles(name, n, inp, out, mean_in, mean_out, span):
    tr = load_trace(bundled_trace(name))
    assert len(tr) == n and tr.skipped == 0
    assert _pcts(tr.input_tokens) == inp
    assert _pcts(tr.output_tokens) == out
    assert abs(tr.input_tokens.mean() - mean_in) < 0.5 and abs(tr.output_tokens.mean() - mean_out) < 0.5
    st = trace_stats(tr)
    assert [st["input"][k] for k in ("p50", "p90", "p99")] == inp
    if span is None:
        assert st["span_s"] is None and not tr.has_timestamps
    else:
        assert round(st["span_s"]) == span
        assert np.all(np.diff(tr.arrival_s) >= 0)


def test_azure_wall_clock_and_format_detection(conv):
    assert conv.format == "azure2023" and conv.start_time == "2023-11-16T18:15:46.680590"
    assert detect_format(bundled_trace("azure-code")) == "azure2023"
    assert detect_format(bundled_trace("sharegpt")) == "sharegpt"
    assert detect_format(bundled_trace("servegen-m-large-80")) == "servegen"
    # 18:15:46.6805900 -> 18:15:50.9951690
    assert abs(conv.arrival_s[1] - 4.314579) < 1e-5


def test_azure_fast_and_slow_timestamp_paths_agree(tmp_path):
    rng = np.random.default_rng(1)
    secs = np.sort(rng.uniform(0, 86400 * 400, 500))
    base = np.datetime64("2023-12-30T00:00:00", "ns")
    ts = base + (secs * 1e9).astype("timedelta64[ns]")
    strs = [str(x).replace("T", " ")[:27] for x in ts]
    from tkcc.traffic.formats_csv import _fixed_width_timestamps

    fast = _fixed_width_timestamps(strs)
    ref = np.array([np.datetime64(s, "ns").astype(np.int64) / 1e9 for s in strs])
    assert fast is not None and np.abs(fast - ref).max() < 1e-5
    # mixed widths fall back to numpy and still parse
    p = tmp_path / "mixed.csv"
    p.write_text(AZ_HEADER + "2023-11-16 18:00:00.5,10,2\n2023-11-16 18:00:01.25,11,3\n2023-11-16 18:00:02,12,4\n")
    tr = load_trace(p)
    assert np.allclose(tr.arrival_s, [0, 0.75, 1.5])


def test_azure_duplicates_are_legal_and_tz_suffix(tmp_path):
    p = tmp_path / "dup.csv"
    p.write_text(AZ_HEADER + "2024-05-10 00:00:00.009930+00:00,5,1\n2024-05-10 00:00:00.009930+00:00,6,0\n"
                 "2024-05-10 00:00:01.000000+00:00,7,3\n")
    tr = load_trace(p)
    assert len(tr) == 3 and tr.arrival_s[1] == 0 and tr.output_tokens[1] == 0


@pytest.mark.parametrize("body,line,field,why", [
    ("2023-11-16 18:00:00.0,10,2\n2023-11-16 18:00:01.0,abc,3\n", 3, "ContextTokens", "not a number"),
    ("2023-11-16 18:00:00.0,10,2\n2023-11-16 18:00:01.0,10,-3\n", 3, "output", "negative"),
    ("2023-11-16 18:00:05.0,10,2\n2023-11-16 18:00:01.0,10,3\n", 3, "timestamp", "backwards"),
    ("2023-11-16 18:00:00.0,10,2\nyesterday,10,3\n", 3, "TIMESTAMP", "not a timestamp"),
    ("2023-11-16 18:00:00.0,10,2\n2023-11-16 18:00:01.0,10\n", 3, "GeneratedTokens", "fields"),
    ("2023-11-16 18:00:00.0,10,2\n2023-11-16 18:00:01.0,1.5,3\n", 3, "ContextTokens", "not a number"),
])
def test_azure_bad_rows(tmp_path, body, line, field, why):
    p = tmp_path / "bad.csv"
    p.write_text(AZ_HEADER + body + "2023-11-16 18:00:09.0,10,2\n")
    with pytest.raises(TraceFormatError) as e:
        load_trace(p)
    assert e.value.line == line and e.value.field == field and why in str(e.value) and str(p) in str(e.value)
    tr = load_trace(p, skip_bad=True)
    assert tr.skipped == 1 and len(tr) == 2
    assert tr.meta["skipped_lines"][0]["line"] == line


def test_missing_column_empty_header_only_unknown(tmp_path):
    p = tmp_path / "cols.csv"
    p.write_text("TIMESTAMP,ContextTokens,Other\n2023-11-16 18:00:00.0,1,2\n")
    with pytest.raises(TraceFormatError, match="missing column 'GeneratedTokens'.*azure2023") as e:
        load_trace(p)  # detection names the format the header nearly is, and what it lacks
    assert e.value.field == "GeneratedTokens" and e.value.line == 1 and str(p) in str(e.value)
    with pytest.raises(TraceFormatError) as e:
        load_trace(p, format="azure2023")
    assert e.value.field == "GeneratedTokens" and e.value.line == 1
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(TraceFormatError, match="empty"):
        load_trace(empty)
    with pytest.raises(TraceFormatError, match="empty"):
        load_trace(empty, format="azure2023", skip_bad=True)
    hdr = tmp_path / "hdr.csv"
    hdr.write_text(AZ_HEADER)
    with pytest.raises(TraceFormatError, match="no requests"):
        load_trace(hdr, skip_bad=True)
    allbad = tmp_path / "allbad.csv"
    allbad.write_text(AZ_HEADER + "x,y,z\n")
    with pytest.raises(TraceFormatError, match="no valid requests"):
        load_trace(allbad, skip_bad=True)
    with pytest.raises(TraceFormatError, match="unknown format"):
        load_trace(hdr, format="parquet")
    with pytest.raises(TraceFormatError, match="no such file"):
        load_trace(tmp_path / "nope.csv")


def test_gzip_and_iter_chunks_match_whole(tmp_path, conv):
    raw = bundled_trace("azure-conv").read_bytes()
    gz = tmp_path / "conv.csv.gz"
    gz.write_bytes(gzip.compress(raw))
    g = load_trace(gz)
    assert np.array_equal(g.input_tokens, conv.input_tokens) and np.allclose(g.arrival_s, conv.arrival_s)
    parts = list(iter_trace(bundled_trace("azure-conv"), chunk_rows=3000))
    assert len(parts) == 7 and max(len(p) for p in parts) <= 3000
    whole = Trace.concat(parts)
    assert np.array_equal(whole.output_tokens, conv.output_tokens)
    assert np.allclose(whole.arrival_s, conv.arrival_s)  # one origin across chunks


def _as_mooncake(tr, path):
    with open(path, "w") as f:
        for i in range(len(tr)):
            f.write(json.dumps({"timestamp": int(round(tr.arrival_s[i] * 1000)), "input_length": int(tr.input_tokens[i]),
                                "output_length": int(tr.output_tokens[i]), "hash_ids": [i, i + 1]}) + "\n")


def test_mooncake_from_real_arrivals(tmp_path, code):
    p = tmp_path / "mooncake_trace.jsonl"
    _as_mooncake(code, p)
    tr = load_trace(p)
    assert tr.format == "mooncake" and len(tr) == len(code)
    assert np.array_equal(tr.input_tokens, code.input_tokens)
    assert np.abs(tr.arrival_s - code.arrival_s).max() <= 0.0005 + 1e-9  # ms resolution
    assert tr.prefix_hashes[5] == [5, 6]
    lines = p.read_text().splitlines(True)
    lines[3] = json.dumps({"timestamp": 5, "input_length": -1, "output_length": 2}) + "\n"
    p.write_text("".join(lines[:20]))
    with pytest.raises(TraceFormatError) as e:
        load_trace(p)
    assert e.value.line == 4 and e.value.field == "input"
    p.write_text("".join(lines[:20]) + '{"timestamp": 99999999, "input_len')
    with pytest.raises(TraceFormatError) as e:
        load_trace(p)
    assert e.value.line == 21 and "truncated" in str(e.value)
    tr = load_trace(p, skip_bad=True)
    assert tr.skipped == 2 and len(tr) == 19
    reasons = " ".join(x["reason"] for x in tr.meta["skipped_lines"])
    assert "truncated JSON line" in reasons and "negative" in reasons


def test_generic_request_log_fields_units_and_sort(tmp_path, conv):
    p = tmp_path / "requests.jsonl"
    epoch = 1_700_000_000.0
    rows = []
    for i in range(200):
        t = epoch + float(conv.arrival_s[i])
        style = i % 3
        if style == 0:
            rows.append({"created": t, "usage": {"prompt_tokens": int(conv.input_tokens[i]),
                                                 "completion_tokens": int(conv.output_tokens[i])}})
        elif style == 1:
            rows.append({"created": t, "usage": {"prompt_tokens": int(conv.input_tokens[i]),
                                                 "completion_tokens": int(conv.output_tokens[i])}, "id": "x"})
        else:
            rows.append({"created": t, "usage": {"prompt_tokens": int(conv.input_tokens[i]),
                                                 "completion_tokens": int(conv.output_tokens[i])}, "model": "m"})
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tr = load_trace(p)
    assert tr.format == "jsonl" and tr.meta["fields"]["input"] == "usage.prompt_tokens"
    assert np.allclose(tr.arrival_s, conv.arrival_s[:200], atol=1e-5)
    assert tr.start_time.startswith("2023-11-14")
    # ms timestamps and vLLM-style names; written at completion time (out of order)
    q = tmp_path / "vllm.jsonl"
    order = np.random.default_rng(0).permutation(50)
    q.write_text("\n".join(json.dumps({"arrival_time": int((epoch + conv.arrival_s[i]) * 1000),
                                       "input_len": int(conv.input_tokens[i]), "output_len": int(conv.output_tokens[i])})
                           for i in order) + "\n")
    with pytest.raises(TraceFormatError, match="backwards"):
        load_trace(q)
    s = load_trace(q, sort=True)
    assert s.meta["reordered"] > 0 and np.array_equal(s.input_tokens, conv.input_tokens[:50])
    assert np.allclose(s.arrival_s, conv.arrival_s[:50] - conv.arrival_s[0], atol=2e-3)
    bad = tmp_path / "nofield.jsonl"
    bad.write_text(json.dumps({"created": 1, "foo": 2}) + "\n")
    with pytest.raises(TraceFormatError, match="unknown JSON-lines"):
        load_trace(bad)
    with pytest.raises(TraceFormatError) as e:
        load_trace(bad, format="jsonl")
    assert e.value.field == "input"


def test_tkcc_format_round_trip_with_moe_counts(tmp_path, code):
    sub = code.select(slice(0, 300))
    rng = np.random.default_rng(0)
    r = Routing.from_olmoe_counts(domain="arxiv", num_layers=4)
    counts = np.zeros((300, 4, 64), dtype=np.int64)
    for layer in range(4):
        picks = r.sample_topk(layer, 300 * 16, rng).reshape(300, 16 * 8)
        for i in range(300):
            counts[i, layer] = np.bincount(picks[i], minlength=64)
    sub.moe_counts = counts
    sub.routing = r
    p = tmp_path / "rec.tkcc.jsonl"
    write_trace(sub, p, model="olmoe-16l")
    back = load_trace(p)
    assert back.format == "tkcc" and back.meta["model"] == "olmoe-16l"
    assert np.array_equal(back.input_tokens, sub.input_tokens) and np.allclose(back.arrival_s, sub.arrival_s, atol=1e-6)
    assert np.array_equal(back.moe_counts, counts)
    assert back.routing.top_k == 8 and back.routing.num_experts == 64
    assert np.allclose(back.routing.probs, counts.sum(0) / counts.sum(0).sum(1, keepdims=True))
    # the recorded skew is the arxiv skew within sampling error
    assert abs(back.routing.imbalance(0) - r.imbalance(0)) / r.imbalance(0) < 0.1
    # a bad moe row and a header-less file
    text = p.read_text().splitlines()
    obj = json.loads(text[2])
    obj["moe"] = [[1, 2]]
    text[2] = json.dumps(obj)
    p.write_text("\n".join(text) + "\n")
    with pytest.raises(TraceFormatError) as e:
        load_trace(p)
    assert e.value.line == 3 and e.value.field == "moe"
    h = tmp_path / "nohdr.jsonl"
    h.write_text('{"t": 0, "in": 1, "out": 1}\n')
    with pytest.raises(TraceFormatError):
        load_trace(h, format="tkcc")


def test_burstgpt_columns(tmp_path):
    p = tmp_path / "BurstGPT_sample.csv"
    p.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,472,18,490,Conversation log\n45,ChatGPT,1087,0,1087,Conversation log\n"
                 "45,GPT-4,417,276,693,API log\n")
    tr = load_trace(p)
    assert tr.format == "burstgpt" and list(tr.output_tokens) == [18, 0, 276] and list(tr.arrival_s) == [5, 45, 45]


def test_servegen_bad_files_and_no_eval(tmp_path):
    base = tmp_path / "chunk-1"
    (tmp_path / "chunk-1-trace.csv").write_text("0,0.5,1.0,Gamma,1.0,2.0\n600,0.2,1.0,Poisson,1,1\n")
    (tmp_path / "chunk-1-dataset.json").write_text(json.dumps({"0": {"input_tokens": "{10: 1.0}",
                                                                     "output_tokens": "{5: 1.0}"}}))
    with pytest.raises(TraceFormatError) as e:
        load_trace(str(base) + "-trace.csv")
    assert e.value.line == 2 and e.value.field == "pattern"
    (tmp_path / "chunk-1-trace.csv").write_text("0,0.5,1.0,Gamma,1.0,2.0\n")
    (tmp_path / "chunk-1-dataset.json").write_text(json.dumps({"0": {
        "input_tokens": "__import__('os').system('echo pwned')", "output_tokens": "{5: 1.0}"}}))
    with pytest.raises(TraceFormatError, match="dict literal"):
        load_trace(str(base) + "-trace.csv")
    (tmp_path / "chunk-1-dataset.json").unlink()
    with pytest.raises(TraceFormatError, match="missing"):
        load_trace(str(base) + "-trace.csv", format="servegen")


def test_all_shared_servegen_clients_load(shared_traces):
    files = sorted(shared_traces.glob("servegen/*/*/chunk-*-trace.csv"))
    assert len(files) >= 10
    for f in files:
        tr = load_trace(f, max_requests=20_000)
        assert tr.format == "servegen" and len(tr) > 100
        assert np.all(np.diff(tr.arrival_s) >= 0) and tr.input_tokens.min() >= 0
