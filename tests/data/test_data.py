import numpy as np
import pytest
import torch

from polytrain import ConfigError
from polytrain.data import EpochBatches, GlobalBatches, get_dataset, shard, stdlib_corpus, windows


def test_corpus_is_real_text_read_offline():
    corpus = stdlib_corpus()
    assert corpus.dtype == torch.uint8 and corpus.numel() > 1 << 20
    assert b"def " in bytes(corpus[:100_000].tolist())


def test_the_corpus_skips_tests_below_the_library_not_a_python_under_a_test_folder(
        tmp_path, monkeypatch):
    # Python installed under /home/test/... read nothing: "test" was looked for in the
    # whole path, and the run was refused ("found only 0 bytes of Python source").
    import sysconfig
    root = tmp_path / "test" / "lib"
    (root / "test").mkdir(parents=True)
    (root / "site-packages").mkdir()
    (root / "a.py").write_bytes(b"a = 1\n" * 20_000)
    (root / "test" / "t.py").write_bytes(b"t = 2\n" * 100)
    (root / "site-packages" / "s.py").write_bytes(b"s = 3\n" * 100)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    stdlib_corpus.cache_clear()  # read once per process: this one reads the folder above
    try:
        assert bytes(stdlib_corpus().tolist()) == b"a = 1\n" * 20_000
    finally:
        stdlib_corpus.cache_clear()


def test_same_seed_gives_the_same_global_batches_and_another_seed_others():
    corpus = get_dataset("text")
    a = [b for _, b in zip(range(3), GlobalBatches(corpus, batch_size=4, window=9, seed=1))]
    b = [b for _, b in zip(range(3), GlobalBatches(corpus, batch_size=4, window=9, seed=1))]
    c = next(iter(GlobalBatches(corpus, batch_size=4, window=9, seed=2)))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c) and a[0].shape == (4, 9) and a[0].dtype == torch.int64


def test_shards_are_equal_contiguous_slices_that_rebuild_the_batch():
    batch = torch.arange(24).view(8, 3)
    parts = [shard(batch, i, 4) for i in range(4)]
    assert torch.equal(torch.cat(parts), batch) and parts[1].tolist() == [[6, 7, 8], [9, 10, 11]]


def test_a_batch_that_does_not_split_evenly_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"global batch 10 is not divisible by 4 .* "
                                          r"HINT: pass a global batch of a multiple of 4 "
                                          r"samples \(--batch-size 12\)"):
        shard(torch.zeros(10), 0, 4)


@pytest.mark.parametrize("index, count", [(2, 2), (-1, 2), (0, 0), (0, -2)])
def test_a_replica_outside_the_replicas_is_refused(index, count):
    # shard(x, 2, 2) and shard(x, -1, 2) gave an empty batch, which trained on nothing (a
    # slice past the end, or from the end); a count of 0 raised a bare ZeroDivisionError.
    with pytest.raises(ConfigError, match=rf"^shard\(\) takes a replica index in 0\.\.count-1 "
                                          rf"and a count of at least 1 \(got index {index}, "
                                          rf"count {count}\)\. HINT: pass shard\(batch, "
                                          rf"ctx\.worker_index, ctx\.num_workers\)$"):
        shard(torch.arange(8), index, count)


def test_a_0_dim_tensor_is_refused_as_a_batch():
    # shard(torch.tensor(3.), 0, 1) raised a bare "IndexError: tuple index out of range": a
    # 0-dim tensor has no dim 0 to slice.
    with pytest.raises(ConfigError, match=r"^shard\(\) takes a global batch whose dim 0 is the "
                                          r"samples, but got a tensor of 0 dims \(one number\)\. "
                                          r"HINT: pass a batch along dim 0 \(one sample x is "
                                          r"x\.unsqueeze\(0\)\)$"):
        shard(torch.tensor(3.0), 0, 1)
    assert shard(torch.tensor([3.0]), 0, 1).tolist() == [3.0]


@pytest.mark.parametrize("batches", [GlobalBatches, EpochBatches])
@pytest.mark.parametrize("options, message", [
    ({"window": 0}, r"window must be at least 1 \(got 0\)\. HINT: pass window=65"),
    ({"window": -3}, r"window must be at least 1 \(got -3\)\. HINT: pass window=65"),
    ({"window": 1.5}, r"window must be a whole number \(got 1\.5\)\. HINT: pass window=65"),
    ({"seed": -1}, r"^seed must be in 0\.\.2\*\*63-1 \(got -1\)\. HINT: pass seed=0$"),
    ({"seed": 2**64}, r"^seed must be in 0\.\.2\*\*63-1 \(got 18446744073709551616\)"),
    ({"seed": None}, r"^seed must be a whole number \(got None\)"),
    ({"window": None}, r"^window must be a whole number \(got None\)"),
    ({"batch_size": None}, r"^--batch-size must be a whole number \(got None\)"),
    ({"batch_size": 2.5}, r"^--batch-size must be a whole number \(got 2\.5\)"),
    ({"seed": 1.5}, r"^seed must be a whole number \(got 1\.5\)\. HINT: pass seed=0$")])
def test_batches_of_a_window_or_seed_torch_cannot_take_are_refused(batches, options, message):
    # window=0 gave empty (4, 0) batches (GlobalBatches) or a ZeroDivisionError (EpochBatches),
    # window=-3 and 1.5 torch's RuntimeError or TypeError; seed=-1 was taken (TrainConfig
    # refuses --seed -1), and seed=2**64 failed at the first batch ("Overflow when unpacking").
    with pytest.raises(ConfigError, match=message):
        batches(torch.arange(100), **{"batch_size": 4, "window": 9, "seed": 0, **options})
    assert next(iter(batches(torch.arange(100), batch_size=4, window=9, seed=2**63 - 1))).shape \
        == (4, 9)
    # numpy's integers pass the check, and torch's generator does not take them: TypeError or
    # OverflowError at the first batch.
    import numpy as np
    assert torch.equal(
        next(iter(batches(torch.arange(100), batch_size=np.int64(4), window=np.int64(9),
                          seed=np.int64(5)))),
        next(iter(batches(torch.arange(100), batch_size=4, window=9, seed=5))))


def test_windows_of_no_tokens_are_refused():
    # windows(corpus, 0) raised a bare ZeroDivisionError.
    with pytest.raises(ConfigError, match=r"^window must be at least 1 \(got 0\)\. HINT: pass "
                                          r"window=65"):
        windows(torch.arange(10), 0)
    assert windows(torch.arange(10), 3).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options, message", [
    ({"model_options": {"seq_len": 5_000_000}},
     r"the corpus has 4194304 tokens, and windows of 5000001 need more \(at least 5000002\)\. "
     r"HINT: pass a smaller --seq-len"),
    ({"sampling": "epoch", "batch_size": 100_000},
     r"the corpus holds 64527 samples of 65 tokens, fewer than one batch of 100000"),
    ({"data": "text-finetune", "eval_every": 1, "model_options": {"seq_len": 7000}},
     r"--eval-every holds out the last tenth of the data, 6554 tokens, fewer than one window "
     r"of --seq-len 7000 \+ 1"),
    ({"model": "wordlm", "model_options": {"seq_len": 5_000_000}},
     r"the corpus has \d+ tokens, and windows of 5000001 need more"),
])
def test_data_too_short_for_the_run_is_refused_before_any_process_starts(options, message):
    # Before, every worker raised it once the processes had started (with its traceback).
    from polytrain.config import TrainConfig

    with pytest.raises(ConfigError, match=message):
        TrainConfig(strategy="ddp", workers=2, **options)



def test_data_a_model_would_ignore_is_refused():
    # wordlm trains on its own corpus: --data text-finetune ran on it, and metrics.json said
    # text-finetune.
    from polytrain.config import TrainConfig

    with pytest.raises(ConfigError, match=r"model 'wordlm' trains on its own corpus, and --data "
                                          r"text-finetune would be ignored"):
        TrainConfig(strategy="single", model="wordlm", data="text-finetune")


def test_a_corpus_exactly_one_window_long_is_refused_in_words_that_are_true():
    # "corpus of 9 tokens is shorter than a window of 9": a window's start is drawn below
    # the corpus's length less the window's, so the corpus needs one token more.
    with pytest.raises(ConfigError, match=r"the corpus has 9 tokens, and windows of 9 need "
                                          r"more \(at least 10\)\. HINT: pass a smaller "
                                          r"--seq-len"):
        GlobalBatches(torch.arange(9), batch_size=2, window=9, seed=0)
    assert next(iter(GlobalBatches(torch.arange(10), batch_size=2, window=9, seed=0))).shape \
        == (2, 9)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, said", [
    ((torch.arange(8), 1.0, 2), r"^shard\(\) index must be a whole number \(got 1\.0\)\. HINT: "
                                r"pass shard\(batch, ctx\.worker_index, ctx\.num_workers\)$"),
    ((torch.arange(8), "1", 2), r"^shard\(\) index must be a whole number \(got '1'\)"),
    ((torch.arange(8), 0, 2.5), r"^shard\(\) count must be a whole number \(got 2\.5\)"),
    ((torch.arange(8), 0, True), r"^shard\(\) count must be a whole number \(got True\)"),
    ((torch.arange(8), False, 2), r"^shard\(\) index must be a whole number \(got False\)"),
    (([1, 2, 3, 4], 0, 2), r"^shard\(\) takes a global batch as a torch\.Tensor \(got type "
                           r"list\)\. HINT: pass torch\.as_tensor\(batch\)"),
    ((np.arange(4), 0, 2), r"^shard\(\) takes a global batch as a torch\.Tensor "
                           r"\(got type ndarray\)"),
    ((torch.zeros(10), 0, 4), r"HINT: pass a global batch of a multiple of 4 samples "
                              r"\(--batch-size 12\)$"),
])
def test_shards_arguments_of_another_kind_are_refused_by_name(args, said):
    # shard(b, 1.0, 2) and shard(b, "1", 2) were TypeErrors, a list or a numpy array
    # AttributeError 'dim', shard(b, 0, 2.5) hinted "--batch-size 10.0", and shard(b, 0, True)
    # was the whole batch, silently. Cause: shard() checked no argument's kind. And a
    # script's batch of 10 over 4 was hinted "pass --batch-size 12", a flag it has none of.
    with pytest.raises(ConfigError, match=said) as e:
        shard(*args)
    assert "\n" not in str(e.value)



def test_shard_takes_whole_numbers_of_numpy_and_one_element_int_tensors():
    # The argument check refused torch.tensor(1) (an index a broadcast carried), which had
    # worked: 0-d int tensors index and divide as ints do.
    batch = torch.arange(8)
    assert shard(batch, torch.tensor(1), torch.tensor(2)).tolist() == [4, 5, 6, 7]
    assert shard(batch, np.int64(0), np.int32(4)).tolist() == [0, 1]
    with pytest.raises(ConfigError, match=r"index must be a whole number"):
        shard(batch, torch.tensor(True), 2)
