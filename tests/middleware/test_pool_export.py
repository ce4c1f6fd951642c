"""forge-pool-export on a real pool database: what the pool stored and scored, as JSON lines, read-only (also while
the pool keeps it open), filtered by state, task and group; text from the tokenizer, images written out; episodes
whose trajectories were not kept are counted, not written; a missing or foreign database is a clear error."""

import io
import json
import sqlite3

import pytest

from forge_megatron.middleware import pool_export
from forge_megatron.middleware.pool import DataPool, PoolConfig
from forge_megatron.middleware.schema import Episode, Segment


def _episode(gid, eid, tok, prompt, answer, reward, images=None, version=3):
    p, a = tok.encode(prompt), tok.encode(answer)
    seg = Segment(tokens=p + a, loss_mask=[0] * len(p) + [1] * len(a),
                  rollout_logprobs=[0.0] * len(p) + [-0.5] * len(a),
                  policy_versions=[-1] * len(p) + [version] * len(a), images=images)
    return Episode(episode_id=eid, group_id=gid, task_id="unused", segments=[seg], reward=reward,
                   reward_terms={"malformed_tool_calls": 0.0}, started_at=10.0, ended_at=12.5, num_tool_calls=2)


def _run(argv, capsys):
    rc = pool_export.main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture()
def filled(tmp_path):
    """A pool (trajectories kept) with two scored groups, one delivered, and an open one; the tokenizer's dir."""
    from transformers import AutoTokenizer

    from forge_megatron.models.tiny import build_tiny_tokenizer

    tok_dir = str(tmp_path / "tok")
    build_tiny_tokenizer(tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    pool = DataPool(PoolConfig(db_path=str(tmp_path / "pool.sqlite"), keep_trajectories=True,
                               generation_batch_groups=4, train_batch_groups=1))
    png = b"\x89PNG\r\n\x1a\n" + b"0" * 32
    g0 = pool.register_group("t-0", 2, domain="math", metadata={"answer": "4"})
    for i, (answer, reward) in enumerate([("4", 1.0), ("5", 0.0)]):
        pool.submit_episode(_episode(g0, f"a{i}", tok, "2+2=", answer, reward, images=[png] if i == 0 else None))
    g1 = pool.register_group("t-1", 2, domain="qa")
    for i, (answer, reward) in enumerate([("Paris", 1.0), ("Rome", 1.0)]):
        pool.submit_episode(_episode(g1, f"b{i}", tok, "Capital of France?", answer, reward))
    g2 = pool.register_group("t-2", 2, domain="qa")
    pool.submit_episode(_episode(g2, "c0", tok, "1+1=", "2", 1.0))  # (its group still running)
    batch = pool.next_batch(1, timeout_s=5)
    yield pool, str(tmp_path / "pool.sqlite"), tok_dir, batch
    pool.close()


def test_export_writes_what_the_pool_stored_and_scored(filled, tmp_path, capsys):
    pool, db, tok_dir, batch = filled
    out = tmp_path / "episodes.jsonl"
    rc, _, err = _run(["--db", db, "--out", str(out), "--tokenizer", tok_dir, "--images-dir", str(tmp_path / "img")],
                      capsys)  # (the pool still has the database open)
    assert rc == 0 and "5 episode(s) of 3 group(s) written" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["episode_id"] for r in rows] == ["a0", "a1", "b0", "b1", "c0"]
    a0, a1, b0, _, c0 = rows
    assert (a0["task_id"], a0["domain"], a0["group_state"], a0["batch_id"]) == ("t-0", "math", "delivered",
                                                                                batch.batch_id)
    assert a0["reward"] == 1.0 and a0["score"] == 1.0 and a1["score"] == 0.0 and a0["success"] is True
    assert a0["advantages"][0] > 0 > a1["advantages"][0]  # group-normalised
    assert a0["metadata"] == {"answer": "4"} and a0["duration_s"] == 2.5 and a0["num_tool_calls"] == 2
    seg = a0["segments"][0]
    assert seg["text"] == "2+2=4" and seg["sampled_text"] == "4" and seg["policy_versions"] == [3, 3]
    assert seg["mean_logprob"] == -0.5 and seg["images"] == 1
    with open(seg["image_files"][0], "rb") as f:
        assert f.read().startswith(b"\x89PNG")
    assert b0["group_state"] == "finished" and b0["advantages"] == [0.0]  # equal rewards: no signal
    assert c0["group_state"] == "running" and "score" not in c0  # not scored yet
    rc, text, _ = _run(["--db", db, "--state", "finished", "--state", "running", "--token-ids"], capsys)
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["episode_id"] for r in rows] == ["b0", "b1", "c0"]
    assert rows[0]["segments"][0]["loss_mask"].count(1) == rows[0]["segments"][0]["sampled_tokens"]
    assert "text" not in rows[0]["segments"][0]  # (no tokenizer)
    rc, text, _ = _run(["--db", db, "--task-id", "t-1", "--limit", "1"], capsys)
    assert [json.loads(line)["episode_id"] for line in text.splitlines()] == ["b0"]
    status = pool.group_status(a0["group_id"])
    assert (status["index"], status["state"]) == (a0["group"], "delivered") and c0["group"] > b0["group"]
    rc, text, _ = _run(["--db", db, "--from-group", str(c0["group"])], capsys)
    assert [json.loads(line)["task_id"] for line in text.splitlines()] == ["t-2"]


def test_episodes_whose_trajectories_were_not_kept_are_counted(tmp_path, capsys):
    from pool_cases import fill_group

    pool = DataPool(PoolConfig(db_path=str(tmp_path / "pool.sqlite"), train_batch_groups=1))
    fill_group(pool, pool.register_group("t", 2), 2)
    batch = pool.next_batch(1, timeout_s=5)
    pool.commit(batch.batch_id)  # committed without --keep-trajectories: the tokens are deleted
    fill_group(pool, pool.register_group("u", 2), 2)
    pool.close()
    rc, text, err = _run(["--db", str(tmp_path / "pool.sqlite")], capsys)
    assert rc == 0 and len(text.splitlines()) == 2
    assert "2 episode(s) of 1 group(s) written; 2 episode(s) without a trajectory" in err


def test_missing_and_foreign_databases_are_refused(tmp_path, capsys):
    rc, _, err = _run(["--db", str(tmp_path / "nope.sqlite")], capsys)
    assert rc == 2 and "does not exist" in err
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE t (x INTEGER)")
    rc, _, err = _run(["--db", str(other)], capsys)
    assert rc == 2 and "is not a data pool database" in err
    rc, _, err = _run(["--db", str(other), "--tokenizer", str(tmp_path)], capsys)
    assert rc == 2


def test_json_lines_go_to_stdout_by_default(filled, capsys, monkeypatch):
    _, db, _, _ = filled
    buffer = io.StringIO()
    monkeypatch.setattr("sys.stdout", buffer)
    assert pool_export.main(["--db", db, "--limit", "2"]) == 0
    assert len(buffer.getvalue().splitlines()) == 2


def test_sft_export_feeds_forge_sft_exactly(tmp_path, capsys):
    """--sft --successful: one token sample per segment of the successful, scored episodes (a segment with images and
    unscored or failed episodes left out, counted); forge-sft trains on them as given: its first loss (the whole
    set in one batch) is transformers' mean negative logprob of exactly the sampled tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.training.sft import load_chats, run_sft

    base = build_tiny_model(str(tmp_path / "base"), seed=2)
    tok = AutoTokenizer.from_pretrained(base)
    pool = DataPool(PoolConfig(db_path=str(tmp_path / "pool.sqlite"), keep_trajectories=True))
    gid = pool.register_group("t-0", 3)
    png = b"\x89PNG\r\n\x1a\n" + b"0" * 32
    for eid, answer, reward, images in (("a", "4", 1.0, None), ("b", "5", 0.0, None), ("c", "4", 1.0, [png])):
        pool.submit_episode(_episode(gid, eid, tok, "What is 2+2? ", answer + " is the answer.", reward, images))
    pool.submit_episode(_episode(pool.register_group("t-1", 2), "d", tok, "1+1=", "2", 1.0))  # (not scored yet)
    pool.close()
    out = tmp_path / "rft.jsonl"
    rc, _, err = _run(["--db", str(tmp_path / "pool.sqlite"), "--out", str(out), "--sft", "--successful"], capsys)
    assert rc == 0 and "2 episode(s) of 1 group(s) written as 1 token sample(s), 1 segment(s) with images" in err
    (sample,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert sample["episode_id"] == "a" and tok.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"])
                                                       if m]) == "4 is the answer."
    chats = load_chats(str(out))
    losses = run_sft(base, chats * 3, str(tmp_path / "sft"), steps=2, lr=1e-3, batch_size=3, log_every=100)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ids = torch.tensor([sample["input_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    mask = torch.tensor(sample["loss_mask"][1:], dtype=torch.float32)
    assert losses[0] == pytest.approx(-(logp * mask).sum().item() / mask.sum().item(), abs=1e-5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: loss_mask must be a list of 0 / 1 as long as input_ids"):
        load_chats(str(bad))
    bad.write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [1, 0, 0]}) + "\n")
    with pytest.raises(ValueError, match="trains no token after the first"):
        load_chats(str(bad))
    bad.write_text(json.dumps({"input_ids": [1, 10**6], "loss_mask": [0, 1]}) + "\n")
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        run_sft(base, load_chats(str(bad)), str(tmp_path / "sft2"), steps=1, lr=1e-3, batch_size=1)


def _scored_groups(tmp_path, tok) -> None:
    """tmp_path/pool.sqlite (trajectories kept): group t-0 of five episodes scored a 1, b 0, c 0.5, d 0 and e 1 (e
    with an image), group t-1 of two equal scores, and t-2 not scored yet."""
    pool = DataPool(PoolConfig(db_path=str(tmp_path / "pool.sqlite"), keep_trajectories=True))
    png = b"\x89PNG\r\n\x1a\n" + b"0" * 32
    gid = pool.register_group("t-0", 5)
    for eid, answer, reward, images in (("a", "4", 1.0, None), ("b", "5", 0.0, None), ("c", "4!", 0.5, None),
                                        ("d", "6", 0.0, None), ("e", "4", 1.0, [png])):
        pool.submit_episode(_episode(gid, eid, tok, "2+2=", answer, reward, images))
    same = pool.register_group("t-1", 2)  # equal scores: nothing to prefer, nothing above or below the mean
    for eid in ("f", "g"):
        pool.submit_episode(_episode(same, eid, tok, "1+1=", "2", 1.0))
    pool.submit_episode(_episode(pool.register_group("t-2", 2), "h", tok, "3+3=", "6", 1.0))  # (not scored yet)
    pool.close()


def test_pairs_export_pairs_each_group_best_against_worst(tmp_path, capsys):
    """--pairs: in a scored group the best episode against the worst, the next best against the next worst, while the
    score gap exceeds --min-gap; groups of equal scores give none, unscored groups none; episodes with images left out
    (counted); forge-rm reads the file and trains on it as given."""
    from transformers import AutoTokenizer

    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.training import preference

    base = build_tiny_model(str(tmp_path / "base"), seed=2)
    tok = AutoTokenizer.from_pretrained(base)
    _scored_groups(tmp_path, tok)
    db, out = str(tmp_path / "pool.sqlite"), tmp_path / "pairs.jsonl"
    rc, _, err = _run(["--db", db, "--out", str(out), "--pairs"], capsys)
    assert rc == 0 and "2 pair(s) of 1 group(s) written, 1 episode(s) with images left out" in err
    pairs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(p["chosen_episode"], p["rejected_episode"]) for p in pairs] == [("a", "d"), ("c", "b")]
    assert pairs[0]["chosen_score"] > pairs[0]["rejected_score"] and pairs[0]["task_id"] == "t-0"
    chosen = pairs[1]["chosen"]
    assert tok.decode([t for t, m in zip(chosen["input_ids"], chosen["loss_mask"]) if m]) == "4!"
    rc, _, err = _run(["--db", db, "--out", str(out), "--pairs", "--min-gap", "0.6"], capsys)
    assert rc == 0 and "1 pair(s) of 1 group(s)" in err and len(out.read_text().splitlines()) == 1
    rc, _, err = _run(["--db", db, "--out", str(out), "--pairs", "--every-pair"], capsys)  # a > c > b = d
    every = [(p["chosen_episode"], p["rejected_episode"]) for p in map(json.loads, out.read_text().splitlines())]
    assert rc == 0 and every == [("a", "c"), ("a", "b"), ("a", "d"), ("c", "b"), ("c", "d")]
    with pytest.raises(SystemExit):
        pool_export.main(["--db", db, "--pairs", "--sft"])
    assert "--pairs labels every scored group's episodes by score" in capsys.readouterr().err

    records = preference.load_pairs(str(out))
    result = preference.run_reward_model(base, records * 4, str(tmp_path / "rm"), steps=2, lr=1e-3, batch_size=2,
                                         log_every=100)
    assert len(result["history"]) == 2 and preference.render_pairs(tok, records)[0].chosen[1] == \
        pairs[0]["chosen"]["loss_mask"]


def test_kto_export_labels_each_episode_against_its_groups_mean(tmp_path, capsys):
    """--kto: each scored episode desirable above its group's mean and undesirable below it (by more than --min-gap);
    groups of equal scores and unscored groups give none; episodes with images left out (counted) and not in the
    mean; forge-kto reads the file and trains on it as given."""
    from transformers import AutoTokenizer

    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.training import kto

    base = build_tiny_model(str(tmp_path / "base"), seed=2)
    tok = AutoTokenizer.from_pretrained(base)
    _scored_groups(tmp_path, tok)
    db, out = str(tmp_path / "pool.sqlite"), tmp_path / "kto.jsonl"
    rc, _, err = _run(["--db", db, "--out", str(out), "--kto"], capsys)
    assert rc == 0 and "4 KTO example(s) (2 desirable) of 1 group(s) written, 1 episode(s) with images left out" in err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(x["episode_id"], x["label"]) for x in lines] == [("a", True), ("b", False), ("c", True), ("d", False)]
    assert all(x["group_mean"] == pytest.approx(0.375) and x["task_id"] == "t-0" for x in lines)
    assert tok.decode([t for t, m in zip(lines[2]["input_ids"], lines[2]["loss_mask"]) if m]) == "4!"
    rc, _, err = _run(["--db", db, "--out", str(out), "--kto", "--min-gap", "0.2"], capsys)  # c is 0.125 above
    assert rc == 0 and [json.loads(x)["episode_id"] for x in out.read_text().splitlines()] == ["a", "b", "d"]
    for argv, message in ((["--kto", "--successful"], "--kto labels every scored group's episodes"),
                          (["--kto", "--pairs"], "--pairs or --kto: one form per export")):
        with pytest.raises(SystemExit):
            pool_export.main(["--db", db, *argv])
        assert message in capsys.readouterr().err

    records = kto.load_examples(str(out))
    examples = kto.render_records(tok, records)
    assert [e.desirable for e in examples] == [True, False, False] and examples[0].sample[1] == lines[0]["loss_mask"]
    result = kto.run_kto(base, records * 2, str(tmp_path / "kto"), steps=2, lr=1e-3, batch_size=3, log_every=100)
    assert len(result["history"]) == 2 and result["balance"] == pytest.approx(0.5)


def test_kto_export_of_every_segment_labels_each_with_its_episode(tmp_path, capsys):
    """--kto --every-segment: an episode whose agent rewrote its context (two segments) gives an example per segment,
    both with the episode's label; the group's mean is over episodes, not segments."""
    from transformers import AutoTokenizer

    from forge_megatron.models.tiny import build_tiny_tokenizer
    from forge_megatron.training import kto

    tok_dir = str(tmp_path / "tok")
    build_tiny_tokenizer(tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    pool = DataPool(PoolConfig(db_path=str(tmp_path / "pool.sqlite"), keep_trajectories=True))
    gid = pool.register_group("t-0", 3)
    long = _episode(gid, "long", tok, "2+2=", "4", 1.0)
    summary = _episode(gid, "long", tok, "summary: 2+2 asked.", "It is 4", 1.0).segments[0]
    long.segments.append(summary)  # (a second segment: the context rewritten)
    pool.submit_episode(long)
    pool.submit_episode(_episode(gid, "short", tok, "2+2=", "5", 0.0))
    pool.submit_episode(_episode(gid, "mid", tok, "2+2=", "4?", 0.6))
    pool.close()
    db, out = str(tmp_path / "pool.sqlite"), tmp_path / "kto.jsonl"
    rc, _, err = _run(["--db", db, "--out", str(out), "--kto", "--every-segment"], capsys)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert rc == 0 and "4 KTO example(s) (3 desirable) of 1 group(s)" in err, err
    assert [(x["episode_id"], x["segment"], x["label"]) for x in lines] == [
        ("long", 0, True), ("long", 1, True), ("short", 0, False), ("mid", 0, True)]
    assert all(x["group_mean"] == pytest.approx((1.0 + 0.0 + 0.6) / 3) for x in lines)  # (episodes, not segments)
    assert tok.decode([t for t, m in zip(lines[1]["input_ids"], lines[1]["loss_mask"]) if m]) == "It is 4"
    assert len(kto.render_records(tok, kto.load_examples(str(out)))) == 4
    rc, _, err = _run(["--db", db, "--out", str(out), "--kto"], capsys)  # (the last segment only)
    assert [json.loads(x)["segment"] for x in out.read_text().splitlines()] == [1, 0, 0]
    with pytest.raises(SystemExit):
        pool_export.main(["--db", db, "--pairs", "--every-segment"])
    assert "--every-segment is for --kto" in capsys.readouterr().err

