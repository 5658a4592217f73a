"""Sample bookkeeping: loss mask, log-probs and weight versions track the response exactly."""

import pytest

from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit


def test_append_response_tokens_keeps_lengths_and_masks():
    s = Sample(tokens=[10, 11, 12])
    s.append_response_tokens([20, 21], trainable=True, log_probs=[-0.5, -1.5], weight_version=3, text="ab")
    s.append_response_tokens([30], trainable=False, text="<tool>")
    s.append_response_tokens([40], trainable=True, log_probs=[-0.25], weight_version=4, text="c")
    assert s.tokens == [10, 11, 12, 20, 21, 30, 40]
    assert s.prompt_length == 3 and s.response_length == 4
    assert s.loss_mask == [1, 1, 0, 1]
    assert s.rollout_log_probs == [-0.5, -1.5, 0.0, -0.25]
    assert s.weight_versions == [3, 3, -1, 4]
    assert s.response == "ab<tool>c"
    s.validate()


def test_trainable_tokens_need_log_probs():
    s = Sample(tokens=[1])
    with pytest.raises(ValueError, match="one log-prob each"):
        s.append_response_tokens([2, 3], trainable=True, log_probs=[-1.0])
    with pytest.raises(ValueError, match="one log-prob each"):
        s.append_response_tokens([2], trainable=True)


def test_validate_names_the_wrong_field():
    s = Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], rollout_log_probs=[0.0], weight_versions=[0, 0])
    with pytest.raises(ValueError, match="rollout_log_probs"):
        s.validate()


@pytest.mark.parametrize(
    "status,mask,remove,expected",
    [
        (Status.COMPLETED, [1], False, True),
        (Status.TRUNCATED, [0, 1], False, True),
        (Status.COMPLETED, [0, 0], False, False),
        (Status.COMPLETED, [1], True, False),
        (Status.ABORTED, [1], False, False),
        (Status.FAILED, [1], False, False),
        (Status.PENDING, [1], False, False),
    ],
)
def test_is_trainable_rule(status, mask, remove, expected):
    s = Sample(status=status, loss_mask=mask, remove_sample=remove)
    assert s.is_trainable() is expected


def test_reward_value_errors_and_dict_key():
    assert Sample(reward={"acc": 1.0, "fmt": 0.5}).reward_value("fmt") == 0.5
    with pytest.raises(ValueError, match="--reward-key"):
        Sample(reward={"acc": 1.0}).reward_value()
    with pytest.raises(ValueError, match="no reward"):
        Sample(reward=float("nan")).reward_value()


def test_round_trip_dict():
    s = Sample(
        group_index=2, index=1, prompt=[{"role": "user", "content": "hi"}], tokens=[1, 2], status=Status.TRUNCATED
    )
    assert Sample.from_dict(s.to_dict()) == s


def test_from_dict_reads_the_old_rollout_id_name():
    """Dumps and checkpoints written before the rename carry ``rollout_id``; it is read into ``episode_id``."""
    d = Sample(tokens=[1, 2], episode_id="ep-3").to_dict()
    assert d["episode_id"] == "ep-3" and "rollout_id" not in d
    old = {k: v for k, v in d.items() if k != "episode_id"} | {"rollout_id": "ep-3"}
    assert Sample.from_dict(old) == Sample(tokens=[1, 2], episode_id="ep-3")
    with pytest.raises(ValueError, match="^a sample dict holds both 'episode_id' and its old name 'rollout_id'$"):
        Sample.from_dict(d | {"rollout_id": "ep-3"})
