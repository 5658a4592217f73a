"""vime-reward-tests: reward from a task's hidden tests, run in a fresh sandbox (:mod:`vime_reward_tests.reward`)."""
