"""The GRPO stage's feed: prompts from the training data, answers the policy samples to them, scored by the rewards
and turned into training rows.

A rollout takes, for each optimizer step it serves, a round of the next prompts of a seeded shuffle of the training
data (each training sample's last answer is cut off; what precedes it is the prompt, the answer is the reference the
rewards compare with), this data rank its contiguous share of each round, so a step trains on the same rows in
every layout. It samples ``rl.group_size`` answers to each prompt with the package's KV-cache decoding,
all of the rank's answers side by side, each with its own seed (drawn from the run's seed and the prompt's place
in the shuffle, so a layout does not change what is sampled). Each answer becomes a row: the prompt, then the answer
(with its end-of-sentence token where it stopped there) as labels, its group's advantage, the sampling policy's
log-probability of each answer token, and with router replay the experts each token went to. One rollout serves
``rl.updates_per_rollout`` optimizer steps, a mini-batch of its rows each.

A prompt that cannot be used (a sample that cannot be read, an image after its answer, a prompt that leaves no room
for ``rl.max_new_tokens`` in ``data.max_seq_len``) is counted and another round of prompts sampled; so is a group
whose answers all score the same under DAPO's dynamic sampling (it carries no advantage), each rank keeping its
first usable groups; after eight rounds such groups fill what is still missing (``rollout/equal_groups_kept``),
and a rollout with too few usable prompts stops the run with a DataError. Rounds are global: every data rank takes
its share of each, so the position saved in a checkpoint (the prompts taken) is the same everywhere. A resume
starts a new rollout there.
"""

from .feed import RolloutFeed
from .prompts import asked
from .rows import answer_row

__all__ = ["RolloutFeed", "answer_row", "asked"]
