"""Train a delta-rule-family language model (or a synthetic task) from the command line.

    python experiments/train.py                      # the default: a small hybrid Gated DeltaNet on the Python
                                                     # standard library's sources, a few minutes on CPU
    python experiments/train.py --preset=mqar-gdn    # a named preset; any flag below overrides it
    python experiments/train.py --data=~/corpus/ --run_dir=runs/mine --steps=2000
    python experiments/train.py --helpfull           # every flag

A run directory holds checkpoints/, metrics.jsonl and loss.png; running the same command again resumes from its
last checkpoint (a different model, data, sequence length, batch size or seed is refused).
Several processes: give every process --coordinator_address=host:port --num_processes=N --process_id=i.
"""

from __future__ import annotations

import dataclasses
import sys

from absl import app, flags, logging

FLAGS = flags.FLAGS

# Named runs. Model fields are ModelConfig fields; the rest are flags of this file.
PRESETS = {
    # The README's command: ~0.3M-parameter hybrid (3 Gated DeltaNet : 1 attention), bytes, CPU-sized.
    "cpu-hybrid": dict(model="tiny-hybrid", d_model=64, n_layers=4, layer_pattern="GGGA", n_heads=2,
                       head_dim=32, n_value_heads=2, value_head_dim=32, n_attn_heads=2, n_kv_heads=1,
                       attn_head_dim=32, compute_dtype="float32", chunk_size=32, task="bytes", seq_len=128,
                       batch_size=8, steps=300, warmup_steps=30, learning_rate=3e-3, eval_every=100,
                       checkpoint_every=100, eval_batches=8),
    "gdn-small-bytes": dict(model="gdn-small", task="bytes", seq_len=2048, batch_size=32, steps=20000,
                            learning_rate=1e-3, warmup_steps=1000, eval_every=1000, checkpoint_every=1000),
    "hybrid-small-bytes": dict(model="qwen3-next-like-small", task="bytes", seq_len=2048, batch_size=32,
                               steps=20000, learning_rate=1e-3, warmup_steps=1000, eval_every=1000,
                               checkpoint_every=1000),
    "mqar-gdn": dict(model="tiny-hybrid", layer_pattern="G", n_layers=2, d_model=128, task="mqar", seq_len=256,
                     mqar_num_kv_pairs=16, mqar_vocab_size=8192, batch_size=64, steps=5000, learning_rate=1e-3,
                     warmup_steps=200, eval_every=500, checkpoint_every=1000),
    "parity-deltanet": dict(model="tiny-hybrid", layer_pattern="D", step_rule="negative_eigenvalues", n_layers=2,
                            d_model=64, task="parity", seq_len=128, batch_size=64, steps=3000, learning_rate=1e-3,
                            warmup_steps=100, eval_every=500, checkpoint_every=1000),
    "modular-brackets-deltanet": dict(model="tiny-hybrid", layer_pattern="D", step_rule="negative_eigenvalues",
                                      n_layers=4, d_model=128, task="modular_brackets", seq_len=64, batch_size=64,
                                      steps=5000, learning_rate=1e-3, warmup_steps=200, eval_every=500,
                                      checkpoint_every=1000),
}
RULE_LETTERS = {"gated_deltanet": "G", "deltanet": "D", "linear_attention": "L", "kda": "K", "attention": "A"}

# Run
flags.DEFINE_enum("preset", "cpu-hybrid", sorted(PRESETS), "Named run; flags given explicitly override it.")
flags.DEFINE_string("run_dir", None, "Checkpoints, metrics.jsonl and loss.png go here (default runs/<preset>); "
                    "an existing run directory is resumed.")
flags.DEFINE_integer("seed", 0, "Parameter initialisation and data order.")
flags.DEFINE_integer("stop_after", None, "End after this step (saving a checkpoint), as if preempted.")
flags.DEFINE_bool("progress_bar", True, "Show a progress bar with ETA (one line per --log_every when not a tty).")
# Model
flags.DEFINE_string("model", None, "Model preset of deltajax.nn.PRESETS (e.g. tiny-hybrid, gdn-small, "
                    "qwen3-next-like-small, kda-hybrid-small, deltanet-small).")
flags.DEFINE_enum("rule", None, sorted(RULE_LETTERS), "Use this mixer in every layer (sets --layer_pattern).")
flags.DEFINE_string("layer_pattern", None, "Mixer letters repeated over the layers: G Gated DeltaNet, D DeltaNet, "
                    "L linear attention, K KDA, A gated softmax attention (e.g. GGGA).")
flags.DEFINE_enum("step_rule", None, ["sigmoid", "negative_eigenvalues", "kaczmarz", "relaxed_kaczmarz",
                                      "longhorn", "efla"], "Write-strength rule of the delta-rule layers.")
flags.DEFINE_integer("d_model", None, "Residual width.")
flags.DEFINE_integer("n_layers", None, "Number of blocks.")
flags.DEFINE_integer("n_heads", None, "Query/key heads of the recurrent layers.")
flags.DEFINE_integer("head_dim", None, "Key width per head.")
flags.DEFINE_integer("n_value_heads", None, "Value heads of the recurrent layers (a multiple of --n_heads).")
flags.DEFINE_integer("value_head_dim", None, "Value width per head.")
flags.DEFINE_integer("n_attn_heads", None, "Query heads of attention layers.")
flags.DEFINE_integer("n_kv_heads", None, "Key/value heads of attention layers.")
flags.DEFINE_integer("attn_head_dim", None, "Head width of attention layers.")
flags.DEFINE_float("mlp_ratio", None, "SwiGLU hidden width / d_model.")
flags.DEFINE_bool("tie_embeddings", None, "Share the embedding and the output projection.")
flags.DEFINE_enum("compute_dtype", None, ["bfloat16", "float32", "float16"], "Precision of the layers' compute "
                  "(parameters and the loss stay float32).")
flags.DEFINE_string("impl", None, "Rule implementation: auto, chunk, scan or a registered kernel.")
flags.DEFINE_integer("chunk_size", None, "Chunk length of the chunked rules (a power of two).")
# Data
flags.DEFINE_enum("task", None, ["bytes", "mqar", "parity", "modular", "modular_brackets"], "What to learn.")
flags.DEFINE_list("data", [], "bytes: corpus files, directories or globs (.txt and other text, .jsonl, "
                  ".parquet); empty: the Python standard library's sources.")
flags.DEFINE_string("text_field", "text", "Field of .jsonl records / column of .parquet files holding the text.")
flags.DEFINE_float("validation_fraction", 0.01, "Share of the documents held out for evaluation.")
flags.DEFINE_integer("mqar_num_kv_pairs", None, "MQAR: key-value pairs per sequence.")
flags.DEFINE_integer("mqar_vocab_size", None, "MQAR: vocabulary (keys from the lower half, values the upper).")
flags.DEFINE_integer("modulus", None, "Modular arithmetic: the modulus.")
flags.DEFINE_integer("seq_len", None, "Training sequence length (evaluation also runs at twice it).")
flags.DEFINE_integer("batch_size", None, "Global batch (rows over all devices and processes).")
# Optimisation
flags.DEFINE_integer("steps", None, "Optimiser steps (the cosine schedule ends here).")
flags.DEFINE_float("learning_rate", None, "Peak learning rate.")
flags.DEFINE_integer("warmup_steps", None, "Linear warmup steps.")
flags.DEFINE_float("min_lr_ratio", None, "Final learning rate / peak.")
flags.DEFINE_float("weight_decay", None, "AdamW decoupled weight decay (matrices only).")
flags.DEFINE_float("beta1", None, "AdamW beta1.")
flags.DEFINE_float("beta2", None, "AdamW beta2.")
flags.DEFINE_float("grad_clip", None, "Clip gradients to this global norm (0: no clipping).")
flags.DEFINE_integer("grad_accum_steps", None, "Split each batch into this many micro-batches (one update).")
# Evaluation, logging, checkpoints
flags.DEFINE_integer("log_every", None, "Log train metrics every this many steps.")
flags.DEFINE_integer("eval_every", None, "Evaluate at 1x and 2x the training length every this many steps "
                     "(0: at the end only).")
flags.DEFINE_integer("eval_batches", None, "Evaluation batches per length.")
flags.DEFINE_integer("checkpoint_every", None, "Save every this many steps (0: at the end only).")
flags.DEFINE_integer("keep_checkpoints", None, "Keep the last this many checkpoints.")
flags.DEFINE_bool("async_checkpoints", None, "Write checkpoints in the background.")
# Devices and processes
flags.DEFINE_integer("sequence_parallel", None, "Devices on the sequence axis (the rest shard the batch).")
flags.DEFINE_float("peak_flops", None, "Peak FLOP/s per device for the MFU estimate (default: from the device "
                   "kind; none on CPU).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 for multi-process runs "
                    "(or DELTAJAX_COORDINATOR_ADDRESS).")
flags.DEFINE_integer("num_processes", None, "Number of processes (or DELTAJAX_NUM_PROCESSES).")
flags.DEFINE_integer("process_id", None, "This process's index (or DELTAJAX_PROCESS_ID).")
flags.DEFINE_string("cpu_collectives", "gloo", "Cross-process collectives on CPU.")

MODEL_FLAGS = ("layer_pattern", "step_rule", "d_model", "n_layers", "n_heads", "head_dim", "n_value_heads",
               "value_head_dim", "n_attn_heads", "n_kv_heads", "attn_head_dim", "mlp_ratio", "tie_embeddings",
               "compute_dtype", "impl", "chunk_size")
DATA_FLAGS = ("task", "text_field", "validation_fraction", "mqar_num_kv_pairs", "mqar_vocab_size", "modulus")
OPTIM_FLAGS = ("learning_rate", "warmup_steps", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip")
LOOP_FLAGS = ("seq_len", "batch_size", "grad_accum_steps", "steps", "log_every", "eval_every", "eval_batches",
              "checkpoint_every", "keep_checkpoints", "async_checkpoints", "sequence_parallel", "peak_flops",
              "progress_bar", "seed")


def setting(name, preset):
    """The flag if given on the command line, else the preset's value, else the flag's default."""
    if FLAGS[name].present or name not in preset:
        return FLAGS[name].value
    return preset[name]


def build_config():
    from deltajax.data import DataConfig
    from deltajax.nn import PRESETS as MODELS
    from deltajax.train import OptimConfig, TrainConfig

    preset = PRESETS[FLAGS.preset]
    model_name = setting("model", preset) or "tiny-hybrid"
    if model_name not in MODELS:
        raise app.UsageError(f"--model must be one of {sorted(MODELS)}, got {model_name!r}")
    model_changes = {n: setting(n, preset) for n in MODEL_FLAGS if setting(n, preset) is not None}
    if FLAGS.rule is not None:
        if FLAGS["layer_pattern"].present:
            raise app.UsageError("give --rule or --layer_pattern, not both")
        model_changes["layer_pattern"] = RULE_LETTERS[FLAGS.rule]
    data_changes = {n: setting(n, preset) for n in DATA_FLAGS if setting(n, preset) is not None}
    data = DataConfig(paths=tuple(FLAGS.data), seed=FLAGS.seed, **data_changes)
    from deltajax.data.pipeline import build_data

    sources = build_data(data, setting("seq_len", preset) or 256)
    model_changes["vocab_size"] = sources.vocab_size  # the data decides the vocabulary
    model = dataclasses.replace(MODELS[model_name], **model_changes)
    optim = OptimConfig(**{n: setting(n, preset) for n in OPTIM_FLAGS if setting(n, preset) is not None})
    loop = {n: setting(n, preset) for n in LOOP_FLAGS if setting(n, preset) is not None}
    config = TrainConfig(model=model, data=data, optim=optim, run_dir=FLAGS.run_dir or f"runs/{FLAGS.preset}",
                         **loop)
    return config.validate(), sources


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    from deltajax.train import initialize_distributed

    initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                           cpu_collectives=FLAGS.cpu_collectives)
    import jax

    from deltajax.nn import count_parameters
    from deltajax.train import NonFiniteLossError, CheckpointError, train

    config, sources = build_config()
    main_process = jax.process_index() == 0
    if main_process:
        print(f"model: {config.model.layer_pattern} x {config.model.n_layers} layers, d_model "
              f"{config.model.d_model}, {count_parameters(config.model):,} parameters; batch {config.batch_size} x "
              f"{config.seq_len} tokens, {config.steps} steps; run_dir {config.run_dir}", flush=True)
    try:
        result = train(config, data=sources, stop_after=FLAGS.stop_after)
    except (NonFiniteLossError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    if main_process:
        for multiple in config.eval_multiples:
            key = f"eval_perplexity@{multiple}x"
            if key in result:
                extra = (f", {result[f'eval_bits_per_byte@{multiple}x']:.3f} bits/byte"
                         if f"eval_bits_per_byte@{multiple}x" in result else "")
                print(f"eval perplexity @{multiple}x ({multiple * config.seq_len} tokens): {result[key]:.3f}{extra}")
        print(f"checkpoints: {config.run_dir}/checkpoints, metrics: {config.run_dir}/metrics.jsonl, "
              f"plot: {config.run_dir}/loss.png", flush=True)


if __name__ == "__main__":
    app.run(main)
