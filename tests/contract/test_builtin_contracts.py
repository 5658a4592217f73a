"""The built-ins run the contract kit, exactly as a third-party plugin would."""

import argparse

import pytest

from vime_core.plugins import get_plugins
from vime_core.testing import RewardFunctionContract, TrainerBackendContract, WeightSyncContract
from vime_core.testing.trainer_args import trainer_args
from vime_core.types import Sample

pytestmark = pytest.mark.contract


class TestExactMatchReward(RewardFunctionContract):
    @pytest.fixture
    def reward_fn(self):
        return get_plugins().resolve("reward", "exact_match")

    @pytest.fixture
    def cases(self):
        return [
            (Sample(response=" 42. ", label="42"), 1.0),
            (Sample(response="Paris", label="paris"), 1.0),
            (Sample(response="41", label="42"), 0.0),
        ]


class TestDiskWeightSync(WeightSyncContract):
    capabilities = {"cleanup", "timeout"}

    @pytest.fixture
    def strategy(self, tmp_path):
        cls = get_plugins().resolve("weight_sync", "disk")
        return cls(argparse.Namespace(update_weight_disk_dir=tmp_path, keep_weight_updates=False))


class TestDiskDeltaWeightSyncXor(WeightSyncContract):
    capabilities = {"cleanup", "timeout", "delta"}
    encoding = "xor"

    @pytest.fixture
    def strategy(self, tmp_path):
        cls = get_plugins().resolve("weight_sync", "disk-delta")
        return cls(
            argparse.Namespace(
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
            argparse.Namespace(
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
        return cls(trainer_args(), tiny_model_dir)
