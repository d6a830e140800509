"""The flags users type, held against the list every CLI took at main 31ef74e (its parsers, read once and written
here): a config reshaped into sections keeps them; and --help shows each section in a group of its own."""

import warnings

import tyro

from config import BenchConfig, DataCommand, DemoConfig, InferConfig, OpenS2VConfig, TrainConfig

CLIS = {"train_a2.py": TrainConfig, "infer.py": InferConfig, "bench.py": BenchConfig, "data.py": DataCommand,
        "demo.py": DemoConfig, "a2.opens2v": OpenS2VConfig}

# every (sub)command's option strings, sorted, as tyro's parser built them at 31ef74e
FLAGS = {
    "train_a2.py": """
        --adam-eps --align-blocks --align-gate-floor --align-gate-power --align-loss --align-model --align-weight
        --attention-backend --cache-dir --checkpoint-fraction --ckpt-every --clip-size --combine --compile --components
        --concatenate-mask --context-parallel --cross-video --data-root --dataset-config --dataset-type --device
        --dry-run --dry-run-ranks --e2v-type --elements --ema-decay --eval-every --eval-manifest --eval-quantiles
        --eval-split --eval.aes-clip --eval.aes-mlp --eval.clip-image --eval.clip-text --eval.dino --eval.face
        --eval.faces --eval.facesim --eval.gme --eval.max-frames --eval.motion-fb --eval.no-motion-fb --expert
        --fp8-base --fp8-matmul --frame-conditioning --frame-extraction --frame-index --frame-sample --frame-stride
        --fsdp --grad-accum --gradient-checkpointing --help --image-encoder --joint-dropout --keep-last --log-every
        --logit-mean --logit-std --lora-alpha --lora-dropout --lora-rank --lora-target --loss-on-references
        --loss-weighting --lr --lr-schedule --manifest --max-grad-norm --max-memory-gb --max-nonfinite-steps --max-steps
        --memory --micro-batch --mixed-precision --model --no-align-loss --no-concatenate-mask --no-cross-video
        --no-dry-run --no-fp8-base --no-fp8-matmul --no-fsdp --no-gradient-checkpointing --no-loss-on-references
        --no-offload-activations --no-precompute --no-reference-augment --no-save-attention --no-skip-bad-samples
        --no-tensorboard --no-val-metrics --num-frames --num-workers --offload-activations --output-dir
        --overfit-batches --precompute --prefix-frames --reference-augment --reference-dropout --reference-layout
        --reference-timestep --resolution --resume --run-name --sam --sample-mode --save-attention --seed
        --sigma-sampling --sigma-shift --skip-bad-samples --source-fps --swap-blocks --target-fps --tensorboard
        --text-dropout --timestep-buckets --training-type --vace-lora-target --vace-scale --vae-sample-mode
        --val-elements --val-every --val-flow-shift --val-guidance-scale --val-metrics --val-prompt --val-steps
        --warmup-steps --weight-decay -h""",
    "infer.py": """
        --clip-size --combine --compare --components --concatenate-mask --control-video --decode --device --dtype
        --element-specs --elements --eval-set --eval.aes-clip --eval.aes-mlp --eval.clip-image --eval.clip-text
        --eval.dino --eval.face --eval.faces --eval.facesim --eval.gme --eval.max-frames --eval.motion-fb
        --eval.no-motion-fb --flow-shift --force --fps --frame-conditioning --frame-index --guidance-scale
        --guidance-scale-2 --guidance-scale-img --height --help --image --image-encoder --lora --lora-high --lora-low
        --lora-scale --mask --model --negative-prompt --no-concatenate-mask --no-force --no-side-by-side --num-frames
        --out --out-dir --prefix-frames --preset --prompt --prompts-file --reference-layout --reference-timestep
        --resolution --sample-mode --save-latents --schedule --scheduler --seed --side-by-side --steps --tolerance
        --transformer --transformer-2 --vace-scale --vae-sample-mode --width -h""",
    "bench.py": """
        --align-blocks --align-dim --align-loss --align-refs --attention-backend --batch --check-backends
        --checkpoint-fraction --clips --compare-run --compile --context-parallel --data-root --device --dry-run
        --dry-run-ranks --dtype --ema-decay --fp8-base --fp8-matmul --frames --fsdp --gradient-checkpointing --height
        --help --layout --lora-rank --max-memory-gb --memory --memory-table --micro-batch --mode --no-align-loss
        --no-dry-run --no-fp8-base --no-fp8-matmul --no-fsdp --no-gradient-checkpointing --no-memory-table
        --no-offload-activations --no-save-attention --num-frames --num-workers --offload-activations --opens2v --out
        --peak-tflops --preset --refs --resolution --save-attention --steps --swap-blocks --training-type --warmup
        --width -h""",
    "data.py": """
        --help -h""",
    "data.py make-sample": """
        --height --help --num-frames --num-samples --width -h""",
    "data.py validate": """
        --adam-eps --align-blocks --align-gate-floor --align-gate-power --align-loss --align-model --align-weight
        --attention-backend --cache-dir --checkpoint-fraction --ckpt-every --clip-size --combine --compile --components
        --concatenate-mask --context-parallel --cross-video --data-root --dataset-config --dataset-type --device
        --dry-run --dry-run-ranks --e2v-type --elements --ema-decay --eval-every --eval-manifest --eval-quantiles
        --eval-split --eval.aes-clip --eval.aes-mlp --eval.clip-image --eval.clip-text --eval.dino --eval.face
        --eval.faces --eval.facesim --eval.gme --eval.max-frames --eval.motion-fb --eval.no-motion-fb --expert
        --fp8-base --fp8-matmul --frame-conditioning --frame-extraction --frame-index --frame-sample --frame-stride
        --fsdp --grad-accum --gradient-checkpointing --help --image-encoder --joint-dropout --keep-last --log-every
        --logit-mean --logit-std --lora-alpha --lora-dropout --lora-rank --lora-target --loss-on-references
        --loss-weighting --lr --lr-schedule --manifest --max-grad-norm --max-memory-gb --max-nonfinite-steps --max-steps
        --memory --micro-batch --mixed-precision --model --no-align-loss --no-concatenate-mask --no-cross-video
        --no-dry-run --no-fp8-base --no-fp8-matmul --no-fsdp --no-gradient-checkpointing --no-loss-on-references
        --no-offload-activations --no-precompute --no-reference-augment --no-save-attention --no-skip-bad-samples
        --no-tensorboard --no-val-metrics --num-frames --num-workers --offload-activations --output-dir
        --overfit-batches --precompute --prefix-frames --reference-augment --reference-dropout --reference-layout
        --reference-timestep --resolution --resume --run-name --sam --sample-mode --save-attention --seed
        --sigma-sampling --sigma-shift --skip-bad-samples --source-fps --swap-blocks --target-fps --tensorboard
        --text-dropout --timestep-buckets --training-type --vace-lora-target --vace-scale --vae-sample-mode
        --val-elements --val-every --val-flow-shift --val-guidance-scale --val-metrics --val-prompt --val-steps
        --warmup-steps --weight-decay --world-size -h""",
    "data.py index": """
        --help -h""",
    "data.py index opens2v": """
        --background --cross-pairs --help --min-aes --min-background-aes --min-crop-ratio --min-gme --no-background
        -h""",
    "data.py index phantom": """
        --help --parquet --videos -h""",
    "data.py index humoset": """
        --help -h""",
    "data.py export-elements": """
        --cross-video --help --limit --manifest --no-cross-video --out --sam -h""",
    "demo.py": """
        --clip --elements --frames --guidance-scale --help --out --prompt --seed --steps -h""",
    "a2.opens2v": """
        --device --eval-set --eval.aes-clip --eval.aes-mlp --eval.clip-image --eval.clip-text --eval.dino --eval.face
        --eval.faces --eval.facesim --eval.gme --eval.max-frames --eval.motion-fb --eval.no-motion-fb --gme-dtype --help
        --json-dir --leaderboard --no-redo --redo --videos -h""",
}


def parser(cls):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # get_parser: the argparse parser tyro.cli builds
        return tyro.extras.get_parser(cls)


def commands(p, prefix: str):
    """(command, its parser) for a parser and each of its subcommands', depth first."""
    yield prefix, p
    for a in p._actions:
        if type(a).__name__ == "_SubParsersAction":
            for name, sub in a.choices.items():
                yield from commands(sub, f"{prefix} {name}")


def all_commands():
    return {name: p for script, cls in CLIS.items() for name, p in commands(parser(cls), script)}


def test_every_cli_takes_the_same_flags():
    got = {name: sorted(s for a in p._actions for s in a.option_strings) for name, p in all_commands().items()}
    assert got.keys() == FLAGS.keys()
    for name, p in got.items():
        want = FLAGS[name].split()
        assert p == want, f"{name}: lost {sorted(set(want) - set(p))}, new {sorted(set(p) - set(want))}"

