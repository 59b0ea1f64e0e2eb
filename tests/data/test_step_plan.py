"""The step-accounting contract: global batch, steps per epoch, splits that cover the same samples."""
import pytest

from library.data import step_plan


def plan(**kw):
    base = dict(bucket_sizes={(64, 64): 10, (64, 128): 3}, images=4, repeats_total=13,
                reg_images=0, reg_samples=0, processes=1, train_batch_size=2,
                gradient_accumulation_steps=1, max_train_epochs=2, max_train_steps=None,
                lr_warmup_steps=0)
    base.update(kw)
    records = (step_plan.EpochSamples, step_plan.BatchShape, step_plan.RunLength)
    return step_plan.make_plan(*(r(**{f: base.pop(f) for f in r.__dataclass_fields__ if f in base})
                                 for r in records))


def test_global_batch_and_steps_from_buckets():
    p = plan()
    assert p.global_batch == 2
    assert p.steps_per_epoch == 5 + 2  # ceil(10/2) + ceil(3/2): a bucket's partial batch is kept
    assert p.total_steps == 14 and p.epochs == 2


def test_process_count_with_same_global_batch_gives_same_plan():
    one = plan(train_batch_size=4, processes=1)
    two = plan(train_batch_size=2, processes=2)
    acc = plan(train_batch_size=1, processes=2, gradient_accumulation_steps=2)
    assert one.global_batch == two.global_batch == acc.global_batch == 4
    assert one.steps_per_epoch == two.steps_per_epoch == acc.steps_per_epoch == 3 + 1
    assert one.total_steps == two.total_steps == acc.total_steps


def test_steps_limit_and_warmup_fraction():
    p = plan(max_train_epochs=None, max_train_steps=10, lr_warmup_steps=0.25)
    assert p.total_steps == 10 and p.epochs == 2  # 7 steps per epoch -> 2 epochs, the last partial
    assert p.warmup_steps == 2  # round(0.25 * 10)
    assert plan(lr_warmup_steps=3).warmup_steps == 3


def test_plan_lines_are_key_value():
    keys = [line.split(":")[0] for line in plan().lines()]
    for k in ("images", "repeats", "reg_images", "batches_per_epoch", "processes", "global_batch",
              "steps_per_epoch", "epochs", "total_steps", "warmup_steps"):
        assert k in keys


def test_what_if_lines_mention_other_process_counts():
    lines = step_plan.what_if_lines(plan(processes=2, train_batch_size=1))
    assert any("with 1 process" in s and "global_batch 1" in s for s in lines)
    assert any("train_batch_size 2" in s for s in lines)


@pytest.mark.parametrize("gb", [1, 2, 3, 4])
def test_epoch_batches_partition_and_single_bucket(gb):
    buckets = [(64, 64)] * 7 + [(64, 128)] * 5
    batches = step_plan.epoch_batches(buckets, seed=1, epoch=3, global_batch=gb)
    seen = sorted(i for b in batches for i in b.indices)
    assert seen == list(range(12))
    for b in batches:
        assert {buckets[i] for i in b.indices} == {b.bucket}
        assert 1 <= len(b.indices) <= gb


def test_epoch_order_depends_on_seed_and_epoch_only():
    buckets = [(64, 64)] * 9
    a = step_plan.epoch_batches(buckets, seed=5, epoch=1, global_batch=2)
    assert a == step_plan.epoch_batches(buckets, seed=5, epoch=1, global_batch=2)
    assert a != step_plan.epoch_batches(buckets, seed=5, epoch=2, global_batch=2)
    assert a != step_plan.epoch_batches(buckets, seed=6, epoch=1, global_batch=2)


@pytest.mark.parametrize("bs,procs,accum", [(4, 1, 1), (2, 2, 1), (1, 2, 2), (1, 4, 1), (1, 1, 4)])
def test_every_split_of_a_global_batch_covers_the_same_samples(bs, procs, accum):
    gb = step_plan.GlobalBatch((64, 64), (7, 3, 9))  # a partial batch of 3 out of 4
    got = [i for a in range(accum) for p in range(procs) for i in gb.micro_batch(a, p, bs, procs)]
    assert sorted(got) == [3, 7, 9]


def test_derive_seed_is_stable():
    assert step_plan.derive_seed("sample", 42, 1, 0) == step_plan.derive_seed("sample", 42, 1, 0)
    assert step_plan.derive_seed("sample", 42, 1, 0) != step_plan.derive_seed("sample", 42, 1, 1)
