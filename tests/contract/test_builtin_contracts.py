"""The built-ins run the contract kit, exactly as a third-party plugin would."""

import pytest

from vime_core.plugins.manager import get_plugins
from vime_core.testing import (
    GroupRewardFunctionContract,
    RewardFunctionContract,
    TrainerBackendContract,
    WeightSyncContract,
)
from vime_core.testing.plugin_context import plugin_context, run_config
from vime_core.testing.trainer_args import trainer_config
from vime_core.types import Sample

pytestmark = pytest.mark.contract


def _cases(rows):
    """``(response, label, expected)`` rows as contract cases."""
    return [(Sample(response=r, label=label), expected) for r, label, expected in rows]


class TestExactMatchReward(RewardFunctionContract):
    @pytest.fixture
    def reward_fn(self):
        return get_plugins().resolve("reward", "exact_match")

    @pytest.fixture
    def cases(self):
        return _cases(
            [
                (" 42. ", "42", 1.0),
                ("Paris", "paris", 1.0),
                ("41", "42", 0.0),
                ("The Eiffel-Tower!", "eiffel tower", 0.0),  # the hyphen joins the words: "eiffeltower"
                ("The Eiffel Tower!", "eiffel tower", 1.0),
                ("<think>Paris</think>London", "Paris", 0.0),  # an answer while thinking does not count
                ("<think>Paris?</think> Paris", "paris", 1.0),
                ("<think>Paris", "paris", 0.0),  # thinking never closed: no answer
                ("3.5", "35", 0.0),  # a decimal point is kept (SQuAD's script would say 1.0)
                ("\u22123", "-3", 1.0),  # unicode minus
                ("-3", "3", 0.0),
                ("1,000", "1000", 1.0),  # thousands separator
                ("", "x", 0.0),
                ("NYC", ["New York City", "NYC"], 1.0),  # a list of acceptable answers
            ]
        )

    @pytest.fixture
    def error_cases(self):
        return [Sample(response="x", label=None), Sample(response="x", label=[])]


class TestF1Reward(RewardFunctionContract):
    @pytest.fixture
    def reward_fn(self):
        return get_plugins().resolve("reward", "f1")

    @pytest.fixture
    def cases(self):
        return _cases(
            [
                ("the cat sat on the mat", "a cat on a mat", 6 / 7),  # P = 3/4, R = 1
                ("Paris", "Paris, France", 2 / 3),  # P = 1, R = 1/2
                ("Paris, France.", "paris france", 1.0),
                ("London", "Paris", 0.0),
                ("", "x", 0.0),
                ("the", "a", 1.0),  # both normalise to nothing (SQuAD's rule)
                ("<think>Paris</think>", "Paris", 0.0),  # the thinking is dropped: empty answer
                ("1,000 people", "1000 people", 1.0),
                ("\u22123 degrees", "-3 degrees", 1.0),
                ("3 degrees", "-3 degrees", 0.5),
                ("New York", ["York", "New York City"], 0.8),  # best of the labels: P = 1, R = 2/3
            ]
        )

    @pytest.fixture
    def error_cases(self):
        return [Sample(response="x", label=None)]


class TestMathReward(RewardFunctionContract):
    """math-verify equivalence of the last boxed answer (in a worker process, which the first case starts)."""

    @pytest.fixture
    def reward_ctx(self):
        return plugin_context(math_verify_timeout=30.0, math_verify_workers=1)

    @pytest.fixture
    def cases(self):
        return _cases(
            [
                (r"So the answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
                (r"\boxed{0.5}", "1/2", 1.0),
                (r"\boxed{1/2}", r"\frac{1}{2}", 1.0),
                (r"\boxed{\dfrac12}", "0.5", 1.0),
                (r"\boxed{\{1,2\}}", "{2,1}", 1.0),  # sets in any order
                (r"\boxed{\{1,2\}}", "{1,3}", 0.0),
                (r"\boxed{[0,1)}", "[0,1)", 1.0),  # intervals, ends included or not
                (r"\boxed{(0,1]}", "[0,1)", 0.0),
                (r"<think>It is \boxed{7}</think> I am not sure.", "7", 0.0),  # the boxed 7 is inside thinking
                (r"<think>maybe \boxed{6}</think> so \boxed{7}", "7", 1.0),
                (r"<think>\boxed{7}", "7", 0.0),  # thinking never closed
                ("\\boxed{\u22123}", "-3", 1.0),  # unicode minus
                (r"\boxed{-3}", "3", 0.0),
                (r"\boxed{1,000}", "1000", 1.0),  # thousands separator
                (r"\boxed{1000}", "1,000", 1.0),
                (r"\boxed{10\text{ cm}}", "10", 1.0),  # units stripped
                (r"\boxed{x = 3}", "3", 1.0),
                (r"\boxed{3} no, wait: \boxed{4}", "4", 1.0),  # the last boxed answer counts
                (r"\boxed{3} no, wait: \boxed{4}", "3", 0.0),
                ("The answer is 5.", "5", 0.0),  # no boxed answer, no fallback
                ("", "5", 0.0),
                (r"\boxed{}", "5", 0.0),
                (r"\boxed{2}", "3", 0.0),
            ]
        )

    @pytest.fixture
    def reward_fn(self):
        return get_plugins().resolve("reward", "math")

    @pytest.fixture
    def error_cases(self):
        return [Sample(response=r"\boxed{1}", label=None), Sample(response=r"\boxed{1}", label="")]


class TestMathRewardLastNumberFallback(TestMathReward):
    """``--math-last-number-fallback``: without a boxed answer the last number counts."""

    @pytest.fixture
    def reward_ctx(self):
        return plugin_context(math_verify_timeout=30.0, math_verify_workers=1, math_last_number_fallback=True)

    @pytest.fixture
    def cases(self):
        return _cases(
            [
                ("The answer is 5.", "5", 1.0),
                ("3 apples and 1,000 pears", "1000", 1.0),
                ("\u22123 is my answer", "-3", 1.0),
                ("I think 1/2", "0.5", 1.0),
                ("<think>it is 5</think> no idea", "5", 0.0),  # numbers while thinking do not count
                (r"\boxed{4}, not 5", "4", 1.0),  # a boxed answer still wins
                ("no number here", "5", 0.0),
            ]
        )


class TestDapoMathReward(RewardFunctionContract):
    """DAPO's rule: +1 iff the normalised text after the last 'Answer:' equals the normalised label, else -1."""

    @pytest.fixture
    def reward_fn(self):
        return get_plugins().resolve("reward", "dapo_math")

    @pytest.fixture
    def cases(self):
        return _cases(
            [
                ("Let me think.\nAnswer: 42", "42", 1.0),
                ("answer : 42", "42", 1.0),  # case-insensitive, spaces around the colon
                ("Answer: 7\nAnswer: 8", "8", 1.0),  # the last one counts
                ("Answer: 7\nAnswer: 8", "7", -1.0),
                ("Answer: $1,000$", "1000", 1.0),
                ("Answer: 10 cm", "10", 1.0),  # unit words removed
                ("Answer: x = 5", "5", 1.0),  # the part after '='
                (r"Answer: \boxed{\frac12}", r"\frac{1}{2}", 1.0),
                (r"Answer: \frac{1}{2}", "0.5", -1.0),  # string comparison: no symbolic equivalence
                (r"Answer: \{1,2\}", r"\{2,1\}", -1.0),  # sets in another order differ
                ("Answer: \u22123", "-3", -1.0),  # DAPO does not map the unicode minus
                (r"\boxed{42}", "42", -1.0),  # no 'Answer:'
                ("", "42", -1.0),
                ("<think>\nAnswer: 42\n</think>\nI give up.", "42", -1.0),  # inside thinking: no answer
                ("Answer: 5\n" + "x" * 300, "5", -1.0),  # only the last 300 characters are read
                ("x" * 1000 + "\nAnswer: 5", "5", 1.0),
            ]
        )

    @pytest.fixture
    def error_cases(self):
        return [Sample(response="Answer: 1", label=None)]


class TestRankGroupReward(GroupRewardFunctionContract):
    """``rank``: pairwise win rate within the group under ``--reward`` (here exact_match)."""

    @pytest.fixture
    def group_reward_fn(self):
        return get_plugins().resolve("group_reward", "rank")

    @pytest.fixture
    def reward_ctx(self):
        return plugin_context(reward="exact_match", reward_key=None)

    @pytest.fixture
    def group_cases(self):
        def group(*responses):
            return [Sample(index=i, response=r, label="x") for i, r in enumerate(responses)]

        return [
            (group("x", "y", "x", "z"), [5 / 6, 1 / 6, 5 / 6, 1 / 6]),  # base [1, 0, 1, 0]
            (group("x", "y", "y", "y"), [1.0, 1 / 3, 1 / 3, 1 / 3]),
            (group("y", "y"), [0.5, 0.5]),  # all tied
            (group("x"), [0.5]),  # nobody to compare with
        ]


class TestDiskWeightSync(WeightSyncContract):
    capabilities = {"cleanup", "timeout"}

    @pytest.fixture
    def strategy(self, tmp_path):
        cls = get_plugins().resolve("weight_sync", "disk")
        return cls(run_config(update_weight_disk_dir=tmp_path, keep_weight_updates=False))


class TestDiskDeltaWeightSyncXor(WeightSyncContract):
    capabilities = {"cleanup", "timeout", "delta"}
    encoding = "xor"

    @pytest.fixture
    def strategy(self, tmp_path):
        cls = get_plugins().resolve("weight_sync", "disk-delta")
        return cls(
            run_config(
                update_weight_disk_dir=tmp_path, keep_weight_updates=False, update_weight_delta_encoding=self.encoding
            )
        )


class TestDiskDeltaWeightSyncOverwrite(TestDiskDeltaWeightSyncXor):
    encoding = "overwrite"


class TestDiskDeltaWeightSyncSub(TestDiskDeltaWeightSyncXor):
    encoding = "sub"


class TestNcclWeightSync(WeightSyncContract):
    """``nccl`` over Gloo (CPU tensors): :meth:`read` joins the trainer's broadcast group as the engine would."""

    capabilities = {"timeout"}

    @pytest.fixture
    def strategy(self):
        cls = get_plugins().resolve("weight_sync", "nccl")
        return cls(
            run_config(
                rollout_num_engines=1,
                rollout_num_gpus_per_engine=1,
                weight_sync_timeout=20.0,
                update_weight_buffer_size=4096,
                update_weight_checksums=True,
            )
        )

    def test_successive_versions_reuse_one_group(self, strategy):
        """Versions 1..3 go over the same group (built once) and each arrives bit-exactly."""
        sent = self.reference_tensors()
        for version in (1, 2, 3):
            sent = self.changed_tensors(sent, version) if version > 1 else sent
            update = strategy.push(iter(sent.items()), version)
            assert update.payload["init"] == (version == 1)
            self.assert_bit_exact(strategy.read(update), sent)
        strategy._wait_sender()
        assert strategy.last_stats.num_tensors == len(sent) and strategy.last_stats.num_buckets >= 2


class TestTorchTrainer(TrainerBackendContract):
    @pytest.fixture
    def trainer(self, tiny_model_dir):
        cls = get_plugins().resolve("trainer", "torch")
        return cls(trainer_config(), tiny_model_dir)
