"""Synthetic tasks as random-access grain sources: MQAR (one setting or a mixture of settings), parity, modular
arithmetic (with and without brackets).

Every source returns examples of one fixed length T as a dict of numpy arrays

    inputs [T] int32, targets [T] int32, weights [T] float32 (1 where the target is scored), segment_ids [T] int32

and example i is a pure function of (seed, i): iteration is deterministic, resumable and shardable by index.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# An index space large enough that no run repeats an example.
NUM_EXAMPLES = 2 ** 40


def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(key=np.array([seed, index], np.uint64)))


def _example(inputs, targets, weights):
    return dict(inputs=np.asarray(inputs, np.int32), targets=np.asarray(targets, np.int32),
                weights=np.asarray(weights, np.float32), segment_ids=np.ones(len(inputs), np.int32))


@dataclasses.dataclass(frozen=True)
class MQAR:
    """Multi-query associative recall (Zoology, Arora et al. 2023).

    The first 2 D tokens are D key-value pairs, keys from the lower half of the vocabulary and values from the
    upper half (disjoint, keys distinct). The rest of the sequence is (T - 2 D) / 2 two-token slots; D of them,
    chosen without replacement with probability proportional to slot^(alpha - 1) (a power law: most queries come
    soon after the context, a few far away), hold a queried key followed by its value. The model is scored on
    predicting the value right after each queried key; all other positions hold random tokens and are unscored.
    """

    seq_len: int
    vocab_size: int = 8192
    num_kv_pairs: int = 16
    power_alpha: float = 0.01
    seed: int = 0

    def __post_init__(self):
        slots = (self.seq_len + 1 - 2 * self.num_kv_pairs) // 2
        if self.num_kv_pairs < 1 or slots < self.num_kv_pairs:
            raise ValueError(f"MQAR needs seq_len + 1 >= 4 * num_kv_pairs; got seq_len={self.seq_len}, "
                             f"num_kv_pairs={self.num_kv_pairs}")
        if self.vocab_size // 2 < self.num_kv_pairs:
            raise ValueError(f"vocab_size // 2 = {self.vocab_size // 2} keys cannot hold {self.num_kv_pairs} "
                             f"distinct keys")

    def __len__(self):
        return NUM_EXAMPLES

    def __getitem__(self, index):
        rng = _rng(self.seed, int(index))
        T, D, half = self.seq_len, self.num_kv_pairs, self.vocab_size // 2
        keys = rng.choice(half, D, replace=False)
        values = rng.integers(half, self.vocab_size, D)
        sequence = rng.integers(0, self.vocab_size, T + 1)  # filler
        sequence[0:2 * D:2], sequence[1:2 * D:2] = keys, values
        slots = (T + 1 - 2 * D) // 2
        p = np.arange(1, slots + 1, dtype=np.float64) ** (self.power_alpha - 1.0)
        chosen = rng.choice(slots, D, replace=False, p=p / p.sum())
        order = rng.permutation(D)
        key_positions = 2 * D + 2 * chosen
        sequence[key_positions], sequence[key_positions + 1] = keys[order], values[order]
        weights = np.zeros(T, np.float32)
        weights[key_positions] = 1.0  # input position of the key, target is the value that follows
        return _example(sequence[:-1], sequence[1:], weights)

    def __repr__(self):
        return f"MQAR(seq_len={self.seq_len}, vocab_size={self.vocab_size}, num_kv_pairs={self.num_kv_pairs})"


@dataclasses.dataclass(frozen=True)
class MQARMixture:
    """MQAR examples of several (sequence length, key-value pairs) settings, each held at one padded length.

    Zoology trains on a mixture of easier settings ((64, 4), (128, 8), (256, 16), (256, 32), (256, 64) at
    vocabulary 8192) and tests at a harder one; a model that sees only the hard setting from the start (64 pairs
    in 512 tokens) stays at the unigram loss for thousands of steps. Example i draws its setting uniformly from
    `settings` and is the MQAR example of that setting (same construction as `MQAR`) followed, up to
    `padded_len`, by random filler tokens in a second segment (segment id 2: the recurrent layers reset there),
    all unscored. Causal models see exactly the short example at its scored positions, and every batch has one
    shape, so one compiled step serves every setting.
    """

    settings: tuple  # ((seq_len, num_kv_pairs), ...)
    vocab_size: int = 8192
    padded_len: int | None = None  # default: the longest seq_len of the settings
    power_alpha: float = 0.01
    seed: int = 0

    def __post_init__(self):
        if not self.settings:
            raise ValueError("MQARMixture needs at least one (seq_len, num_kv_pairs) setting")
        object.__setattr__(self, "settings", tuple((int(t), int(d)) for t, d in self.settings))
        if self.padded_len is None:
            object.__setattr__(self, "padded_len", max(t for t, _ in self.settings))
        for t, d in self.settings:
            if t > self.padded_len:
                raise ValueError(f"setting ({t}, {d}) is longer than padded_len={self.padded_len}")
            MQAR(t, vocab_size=self.vocab_size, num_kv_pairs=d, power_alpha=self.power_alpha)  # validates

    @property
    def seq_len(self) -> int:
        return self.padded_len

    def __len__(self):
        return NUM_EXAMPLES

    def setting(self, index) -> tuple:
        """The (seq_len, num_kv_pairs) of example `index`."""
        return self.settings[int(_rng(self.seed, int(index)).integers(len(self.settings)))]

    def __getitem__(self, index):
        seq_len, pairs = self.setting(index)
        # The example and its filler use streams of their own (keys seed + k 2^32, apart from every plain source's
        # seed), so neither depends on the draw above nor repeats another source's examples.
        example = MQAR(seq_len, vocab_size=self.vocab_size, num_kv_pairs=pairs, power_alpha=self.power_alpha,
                       seed=self.seed + (1 << 32))[index]
        pad = self.padded_len - seq_len
        if pad == 0:
            return example
        filler = _rng(self.seed + (2 << 32), int(index)).integers(0, self.vocab_size, pad + 1)
        return dict(inputs=np.concatenate([example["inputs"], filler[:-1]]).astype(np.int32),
                    targets=np.concatenate([example["targets"], filler[1:]]).astype(np.int32),
                    weights=np.concatenate([example["weights"], np.zeros(pad, np.float32)]),
                    segment_ids=np.concatenate([example["segment_ids"], np.full(pad, 2, np.int32)]))

    def __repr__(self):
        mix = ", ".join(f"({t}, {d})" for t, d in self.settings)
        return f"MQARMixture({mix}; padded_len={self.padded_len}, vocab_size={self.vocab_size})"


@dataclasses.dataclass(frozen=True)
class Parity:
    """Running parity of a random bit string: inputs b_1..b_T in {0, 1}, target_t = (b_1 + ... + b_t) mod 2.

    The state-tracking task of Grazzi et al. 2024 ("Unlocking State-Tracking in Linear RNNs Through Negative
    Eigenvalues"), scored at every position.
    """

    seq_len: int
    seed: int = 0
    vocab_size: int = 2

    def __len__(self):
        return NUM_EXAMPLES

    def __getitem__(self, index):
        bits = _rng(self.seed, int(index)).integers(0, 2, self.seq_len)
        return _example(bits, np.cumsum(bits) % 2, np.ones(self.seq_len))


@dataclasses.dataclass(frozen=True)
class ModularArithmetic:
    """Evaluate a random expression modulo `modulus` (Deletang et al. 2023, used by Grazzi et al. 2024).

    Tokens: digits 0..m-1, then + - * = ( ) and a padding token. Without brackets the expression is
    a_1 o_1 a_2 ... a_n with the usual precedence (* before + and -); with brackets it is a random binary
    expression tree, every inner operand parenthesised. The expression is followed by "=", whose target is the
    value of the expression (the only scored position); the rest is padding. Lengths are uniform up to the
    largest expression that fits.
    """

    seq_len: int
    modulus: int = 5
    brackets: bool = False
    seed: int = 0

    @property
    def vocab_size(self) -> int:
        return self.modulus + 7

    @property
    def tokens(self) -> dict:
        m = self.modulus
        return {"+": m, "-": m + 1, "*": m + 2, "=": m + 3, "(": m + 4, ")": m + 5, "pad": m + 6}

    def __post_init__(self):
        if self.modulus < 2:
            raise ValueError(f"modulus must be >= 2, got {self.modulus}")
        if self.seq_len < 4:
            raise ValueError(f"modular arithmetic needs seq_len >= 4, got {self.seq_len}")

    def __len__(self):
        return NUM_EXAMPLES

    def _flat(self, rng, max_tokens):
        n = int(rng.integers(1, (max_tokens + 1) // 2 + 1))  # operands; 2 n - 1 tokens
        operands = rng.integers(0, self.modulus, n)
        ops = rng.choice(["+", "-", "*"], n - 1)
        # Precedence: sum of products, each product a run of * between + / -.
        total, term, sign = 0, int(operands[0]), 1
        for op, a in zip(ops, operands[1:]):
            if op == "*":
                term = term * int(a)
            else:
                total += sign * term
                term, sign = int(a), (1 if op == "+" else -1)
        total += sign * term
        tokens = [int(operands[0])]
        for op, a in zip(ops, operands[1:]):
            tokens += [self.tokens[op], int(a)]
        return tokens, total % self.modulus

    def _tree(self, rng, leaves):
        """(tokens, value) of a random expression with `leaves` operands; inner operands are parenthesised."""
        if leaves == 1:
            a = int(rng.integers(0, self.modulus))
            return [a], a
        left = int(rng.integers(1, leaves))
        op = str(rng.choice(["+", "-", "*"]))
        lt, lv = self._tree(rng, left)
        rt, rv = self._tree(rng, leaves - left)
        wrap = lambda t, n: ([self.tokens["("]] + t + [self.tokens[")"]]) if n > 1 else t
        value = {"+": lv + rv, "-": lv - rv, "*": lv * rv}[op] % self.modulus
        return wrap(lt, left) + [self.tokens[op]] + wrap(rt, leaves - left), value

    def __getitem__(self, index):
        rng = _rng(self.seed, int(index))
        max_tokens = self.seq_len - 1  # room for "="
        if self.brackets:
            # n leaves take at most 4 n - 3 tokens (n operands, n - 1 operators, <= 2 (n - 1) brackets).
            leaves = int(rng.integers(1, (max_tokens + 3) // 4 + 1))
            tokens, value = self._tree(rng, leaves)
        else:
            tokens, value = self._flat(rng, max_tokens)
        equals = len(tokens)
        inputs = np.full(self.seq_len, self.tokens["pad"], np.int32)
        inputs[:equals] = tokens
        inputs[equals] = self.tokens["="]
        targets = np.full(self.seq_len, self.tokens["pad"], np.int32)
        targets[equals] = value
        weights = np.zeros(self.seq_len, np.float32)
        weights[equals] = 1.0
        return _example(inputs, targets, weights)
