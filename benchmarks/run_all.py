"""Run every benchmark and write benchmarks/results/README.md (the table docs/benchmarks.md shows).

    python benchmarks/run_all.py [--skip-slow]

Each benchmark runs in its own process (8 simulated CPU devices; MFU on the GPU when one is
there) and writes its JSON result;
the table is then built from the JSON files only, so every figure in it comes from a run.
"""

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"


# benchmark 20's row of shardax 0.1's default run, measured from that checkout (--source its src/)
GPT_PRESETS = "0.1 presets (layer norm, GELU)"


def run(args):
    print("+", " ".join(args), flush=True)
    subprocess.run([sys.executable, *args], check=True, cwd=HERE.parent)


def has_gpu() -> bool:
    probe = "import jax; print(jax.devices()[0].platform)"
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return found.stdout.strip() == "gpu"


def load(name):
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def mb(value):
    return f"{value / 1e6:.2f} MB"


def gpu_decisions_rows(decisions: dict | None) -> list[str]:
    """Benchmark 24: each group of the step's choices timed on a GPU, one row per group."""
    if not decisions:
        return []
    lines = []
    for key, rows in decisions.items():
        if not isinstance(rows, dict):
            continue
        parts = [f"{label}: " + (f"{row['step_ms']:.1f} ms, MFU {100 * row['mfu']:.1f}%, "
                                 f"{row['compiled_peak_bytes'] / 1e9:.1f} GB" if "error" not in row
                                 else "out of memory" if "RESOURCE_EXHAUSTED" in row["error"] else row["error"])
                 for label, row in rows.items()]
        lines.append(f"| 24. The step's choices timed on one {decisions['machine']}, `{key}`, dp, bf16 (median of "
                     f"{decisions['steps']} steps; compiled peak) | {'; '.join(parts)} | keep what is faster |")
    return lines


def _aborts(stress: dict) -> str:
    """Benchmark 25's cell: each command's aborts in XLA's default pool vs shardax's."""
    by_command: dict[str, list[str]] = {}
    for key, row in stress["summary"].items():
        command, pool = key.split(" | ")
        by_command.setdefault(command, []).append(f"{row['aborts']} of {row['runs']} ({pool})")
    return "; ".join(f"{command}: {' vs '.join(counts)}" for command, counts in by_command.items())


def experts_rows(experts: dict | None) -> list[str]:
    if not experts:
        return []
    model, rows = experts["model"], experts["strategies"]
    cells = "; ".join(f"{name} on {row['mesh']}: {row['experts_held_per_device']:g} experts' bytes a device, "
                      f"all-to-all {mb(row['all_to_all_bytes_compiled'])} ("
                      + (f"{row['all_to_all_vs_theory']:.3f}x theory" if row["all_to_all_vs_theory"] else "none")
                      + f"), step {row['step_s']:.2f} s ({row['step_time_vs_dp']:.2f}x dp's)"
                      for name, row in rows.items())
    return [f"| 27. a mixture of {model['n_experts']} experts ({model['experts_per_token']} per token), Mixtral-style "
            f"{model['d_model']}-wide, {model['n_layers']} layers, batch {experts['batch']} x {model['seq_len']}, "
            f"{experts['machine']}: experts held per device, compiled all-to-all bytes per device and step / "
            f"theory, step time (median of interleaved steps) | {cells} | E / X experts a device; 1.000x theory |"]


def user_experts_rows(found: dict | None) -> list[str]:
    if not found:
        return []
    model = found["model"]
    cells = "; ".join(f"{row['strategy']} on {row['mesh']}: experts {mb(row['experts_bytes_per_chip'])} of "
                      f"{mb(row['experts_bytes_total'])} a chip, peak {row['peak_bytes_per_chip'] / 1e9:.3f} GB, "
                      f"all-to-all {mb(row['all_to_all_bytes'])}, expert weights gathered "
                      f"{mb(row['expert_weight_gather_bytes'])}" for row in found["rows"])
    return [f"| 28. a user's own Switch-style mixture (stacked expert weights, one-hot dispatch, no annotations), "
            f"{model['EXPERTS']} experts ({model['TOP_K']} per token), {model['D_MODEL']}-wide, {model['LAYERS']} "
            f"layers, batch {found['batch']} x {found['length']}, compiled by XLA:TPU for {found['target']}: the "
            f"experts' dimension read off the program | {cells} | 1 / X of the experts a chip; tokens travel "
            f"(all-to-all), weights do not |"]


def plan_init_from_rows(found: dict | None) -> list[str]:
    if not found:
        return []
    cells = "; ".join(f"{row['target']} {'LoRA ' + str(row['lora_rank']) if row['lora_rank'] else 'full'}: "
                      f"{row['compiled_bytes_per_device'] / 2**30:.2f} GiB a device "
                      f"({'fits' if row['fits'] else 'does not fit'}), analytic {row['predicted_vs_compiled']:.3f}x, "
                      f"roofline {row['step_ms']:.0f} ms, MFU {100 * row['mfu']:.1f}%" for row in found["rows"])
    return [f"| 29. `shardax plan --init-from` a {found['model']} (no weights), fsdp, {' '.join(found['flags'][2:-1])}: "
            f"compiled memory per device, shardax's analytic peak / the compiled one, roofline step and MFU | "
            f"{cells} | analytic within 5% |"]


def post_training_rows(found: dict | None) -> list[str]:
    if not found:
        return []
    rate, epoch, steps = found["learned_tokens_per_s"], found["epoch_s"], found["step_s"]
    ratios = found["dpo_vs_sft"]
    return [f"| 30. SFT on python-chats ({found['conversations']} conversations, bytes), LoRA 8, dp on 8 devices, "
            f"{found['rows']} rows of {found['row_tokens']} a step ({found['machine']}): assistant tokens learned a "
            f"second and an epoch's time, packed / one a row | {rate['packed']:,.0f} / {rate['unpacked']:,.0f} "
            f"tokens/s ({found['packed_vs_unpacked']:.2f}x); epoch {epoch['packed']:.0f} / {epoch['unpacked']:.0f} s "
            f"({found['epoch_rows']['packed']} / {found['epoch_rows']['unpacked']} rows) | packed faster |",
            f"| 30. DPO step, {found['pairs']} pairs ({2 * found['pairs']} rows), against the SFT step of "
            f"{found['rows']} rows: the base weights as reference / its log-probabilities given | "
            f"{ratios['dpo_base_reference']:.2f}x / {ratios['dpo_given_reference']:.2f}x "
            f"({1000 * steps['dpo_base_reference']:.0f} / {1000 * steps['dpo_given_reference']:.0f} vs "
            f"{1000 * steps['sft_unpacked']:.0f} ms) | one more forward, about 1.33x; given: 1x |"]


def table() -> str:
    lines = ["| benchmark | result | target |", "|---|---|---|"]
    overhead = load("overhead")
    if overhead:
        spread = overhead.get("ratio_quartiles")
        spread = f"quartiles {spread[0]:.3f} to {spread[1]:.3f}; " if spread else ""
        lines.append(f"| 1. step time vs the same step hand-written with `jax.jit` and optax (tiny, dp, 8 devices; "
                     f"median of interleaved pairs) | {overhead['ratio']:.3f}x ({spread}"
                     f"{1000 * overhead['shardax_step_s']:.0f} vs {1000 * overhead['hand_written_step_s']:.0f} ms) "
                     f"| <= 1.03 |")
    comm = load("memory_and_communication")
    if comm:
        for row in comm["strategies"]:
            lines.append(f"| 2./3. {row['strategy']} on {row['mesh']}: compiled/predicted state, peak (remat none; "
                         f"full), communication compiled/theory | {row['memory_ratio']:.4f}, {row['peak_ratio']:.3f} "
                         f"({mb(row['peak_bytes_compiled'])}); {row['remat_full_peak_ratio']:.3f} "
                         f"({mb(row['remat_full_peak_bytes_compiled'])}), {row['communication_ratio']:.3f} "
                         f"({mb(row['collective_bytes'])} vs {mb(row['theoretical_collective_bytes'])}) "
                         f"| 1 +- 0.02, 1 +- 0.05, <= 1.05 |")
    compile_ = load("compile_time")
    if compile_:
        seconds = compile_["seconds"]
        lines.append(f"| 4. compile time, 32 layers / 4 layers (scan; median of {compile_.get('rounds', 1)} paired fresh "
                     f"compiles, order alternating, after a warm-up) | {compile_['ratio']:.2f}x "
                     f"({seconds['32']:.1f} s vs {seconds['4']:.1f} s) | <= 1.5 |")
    notebook = load("notebook_step_time")
    if notebook:
        spread = notebook.get("tokens_per_s_ratio_quartiles")
        spread = f"quartiles {spread[0]:.3f} to {spread[1]:.3f}; " if spread else ""
        lines.append(f"| 5. tokens/s, `notebook` preset, blocks in a loop like the notebook's, vs the notebook's own code "
                     f"(median of interleaved pairs) | {notebook['tokens_per_s_ratio']:.3f}x ({spread}"
                     f"{notebook['shardax_tokens_per_s']:,.0f} vs {notebook['notebook_tokens_per_s']:,.0f} tok/s, the medians) | >= 1.0 |")
    largest = load("largest_model")
    if largest:
        budget = largest["budget_bytes_per_device"] / 1e9
        for row in largest["strategies"]:
            best = row["largest"]
            text = "none" if not best else (f"{best['parameters'] / 1e6:.0f}M parameters (d_model {best['d_model']}, "
                                             f"{best['n_layers']} layers), peak {best['peak_bytes'] / 1e9:.2f} GB")
            schedule = f", {row['microbatches']} microbatches" if row.get("microbatches") else ""
            lines.append(f"| 6. largest model under {budget:.0f} GB/device, {row['strategy']} on {row['mesh']}{schedule} "
                         f"| {text} | - |")
    bubble = load("pipeline_bubble")
    if bubble:
        for case in bubble["cases"]:
            circular = f", {case['repeats']} repeats" if case["repeats"] > 1 else ""
            lines.append(f"| 11. pipeline bubble on {bubble['mesh']}, M = {case['microbatches']}{circular}: idle stage "
                         f"iterations of the compiled loops ({case['compiled_iterations']} run) | "
                         f"{100 * case['bubble_compiled']:.1f}% (formula {100 * case['bubble_formula']:.1f}%) | = formula |")
    vmaps = load("pipeline_vmap")
    if vmaps:
        ratio, median = vmaps["nnx_over_jax"], vmaps["median"]["jax.vmap"]
        same = "the same program and loss" if vmaps["same_loss"] and ratio["stablehlo_chars"] == 1 else "DIFFERENT programs"
        lines.append(f"| 11. stages applied by `nnx.vmap` / by `jax.vmap` (shardax's), one pp step on {vmaps['mesh']}, "
                     f"{vmaps['model']['n_layers']} layers of d_model {vmaps['model']['d_model']}, median of "
                     f"{vmaps['rounds']} fresh compiles each | {same}; compile {ratio['compile_s']:.2f}x "
                     f"({median['compile_s']:.1f} s), peak host memory while compiling {ratio['peak_rss_growth_mb']:.2f}x "
                     f"({median['peak_rss_growth_mb']:.0f} MB), temporaries {ratio['temp_bytes']:.2f}x | measured before "
                     f"choosing |")
    longest = load("longest_sequence")
    if longest:
        budget = longest["budget_bytes_per_device"] / 1e9
        rows = longest["rows"]
        text = "; ".join(f"C={r['context']} {r['attention']}: {r['longest_tokens']:,} tokens"
                         + (f" ({r['ratio_to_one_device']:.1f}x)" if "ratio_to_one_device" in r else "") for r in rows)
        lines.append(f"| 12. longest sequence under {budget:.0f} GB/device, `{longest['preset']}`, one sequence per step, "
                     f"context axis of C | {text} | >= 6x |")
        for row in longest["communication"]:
            lines.append(f"| 12. communication per step, C=8 {row['attention']}, {row['seq_len']} tokens: compiled / "
                         f"theory | {row['compiled_over_theory']:.3f} ({row['compiled_bytes'] / 1e6:.0f} MB) | 1 +- 0.05 |")
    accuracy = load("plan_accuracy")
    if accuracy:
        for case, (low, high) in accuracy["predicted_over_compiled_peak"].items():
            lines.append(f"| 2. plan's peak, predicted/compiled: {case} | {low:.3f} to {high:.3f} | 1 +- 0.05 |")
    held_out = load("plan_held_out")
    if held_out:
        groups: dict[tuple[bool, str], list[float]] = {}
        for case in held_out["cases"]:
            kind = "blocks in a loop" if case.get("scan_layers") is False else f"remat {case.get('remat', 'none')}"
            groups.setdefault((case.get("large_rows", False), kind), []).append(case["peak_ratio"])
        for (large, kind), ratios in sorted(groups.items(), key=lambda item: item[0][0]):
            worst = max(abs(r - 1) for r in ratios)
            many = len(ratios) // (3 if large else 7)
            how = ("many rows per device: dp on data=1, fsdp on data=2, tp on data=2,model=4 with twice the batch"
                   if large else "7 strategies")
            lines.append(f"| 2. plan's peak, predicted/compiled (XLA:CPU), shapes never fitted on, {kind}: "
                         f"{many} shape{'s' if many > 1 else ''} x {how} | {min(ratios):.3f} to {max(ratios):.3f} "
                         f"(worst {100 * worst:.1f}%, median {100 * statistics.median(abs(r - 1) for r in ratios):.1f}%) "
                         f"| 1 +- 0.05 |")
    trainer = load("trainer_overhead")
    if trainer:
        for case in trainer["cases"]:
            low, high = case["ratio_quartiles"]
            lines.append(f"| 8. `Trainer` step time / a hand-written loop calling the same jitted step, {case['case']} | "
                         f"{case['ratio']:.3f} (quartiles {low:.3f} to {high:.3f}; {1000 * case['trainer_step_s']:.1f} vs "
                         f"{1000 * case['hand_written_step_s']:.1f} ms) | <= 1.02 |")
    data = load("lm_data")
    if data:
        lines.append(f"| 9. `shardax prepare` throughput, {data['text_bytes'] / 1e6:.0f} MB of stdlib-made JSON lines, "
                     f"{data['cores']} cores: bytes; BPE 4096 (training included) | {data['prepare_bytes_mb_per_s']:.1f} MB/s; "
                     f"{data['prepare_bpe_mb_per_s']:.1f} MB/s | - |")
        loading = data["loading"]
        lines.append(f"| 9. data loading / step time, `tiny` on the byte shards (dp, 8 devices): the batch function "
                     f"alone; the loop reading shards / the same loop reusing one batch (interleaved) | "
                     f"{100 * data['loading_fraction']:.2f}% ({1000 * loading['batch_fn_alone_s']:.2f} of "
                     f"{1000 * loading['step_s_fixed_batch']:.0f} ms); {loading['ratio']:.3f}x | <= 2% |")
        lines.append(f"| 9. peak resident memory of `shardax train`, {data['shards_large_bytes'] / 1e9:.2f} GB vs "
                     f"{data['shards_small_bytes'] / 1e9:.2f} GB of shards | {data['peak_rss_ratio']:.3f} "
                     f"({data['peak_rss_large_bytes'] / 1e6:.0f} vs {data['peak_rss_small_bytes'] / 1e6:.0f} MB) | 1 +- 0.10 |")
    versus = load("bpe_vs_bytes")
    if versus:
        lines.append(f"| 10. validation bits per byte after {versus['steps']} steps of `{versus['preset']}` on the stdlib: "
                     f"BPE {versus['vocab_size']} vs bytes (same held-out documents) | {versus['bpe']['val_bits_per_byte']:.3f} "
                     f"vs {versus['bytes']['val_bits_per_byte']:.3f} ({versus['bits_per_byte_ratio']:.3f}x) | < 1 |")
    for name in ("layer_vjps", "layer_vjps_gpu"):
        vjps = load(name)
        if vjps:
            low, high = vjps["speedup_quartiles"]
            memory = "; ".join(f"{preset} {peaks['custom'] / 1e9:.2f} vs {peaks['autodiff'] / 1e9:.2f} GB"
                               for preset, peaks in vjps["memory_only"].items())
            lines.append(f"| 13. layer norm and GELU with custom VJPs / plain autodiff ({vjps['machine']}; dp on "
                         f"{vjps['mesh']}, {vjps['compute_dtype']}): "
                         f"step time of `{vjps['preset']}` (median of interleaved pairs); compiled peak per device | "
                         f"{vjps['speedup']:.3f}x faster (quartiles {low:.3f} to {high:.3f}; "
                         f"{1000 * vjps['custom_step_s']:.0f} vs {1000 * vjps['autodiff_step_s']:.0f} ms); "
                         f"{vjps['custom_peak_bytes'] / 1e9:.3f} vs {vjps['autodiff_peak_bytes'] / 1e9:.3f} GB; "
                         f"{memory} | >= 1.0, less memory |")
    gpu = load("gpu_checks")
    if gpu:
        for case in gpu.get("cudnn_attention", {}).get("cases", []):
            lines.append(f"| 14. cuDNN attention in the model, `small` in bf16, {case['batch']} ({gpu['machine']}): worst "
                         f"gradient error vs fp32, cuDNN / XLA bf16 | {case['cudnn']['worst_gradient_error']:.2e} / "
                         f"{case['xla']['worst_gradient_error']:.2e} ({'passes' if case['passes'] else 'FAILS'}) | "
                         f"<= 1.5x XLA's |")
        plan = gpu.get("plan")
        if plan and plan["ratio_range"]:
            low, high = plan["ratio_range"]
            lines.append(f"| 14. plan's peak, predicted/compiled on the GPU ({gpu['machine']}), dp on one device in float32, "
                         f"presets and held-out shapes | {low:.3f} to {high:.3f} (worst {100 * plan['worst_abs_error']:.1f}%) "
                         f"| XLA:CPU estimate |")
    integrity = load("checkpoint_integrity")
    if integrity:
        for row in integrity["rows"]:
            two = row["check_over_processes"]
            lines.append(
                f"| 15. checkpoint of {row['checkpoint_bytes'] / 1e6:.0f} MB, one process ({integrity['machine']}): "
                f"`save` blocks; committed after; of which hashing; checking at resume, blocks on "
                f"{row['check_threads']} threads / whole files on one; over 2 processes / 1 (one thread each) | "
                f"{1000 * row['save_blocks_s']:.0f} ms; {row['committed_after_s']:.2f} s; "
                f"{row['sealing_hash_s']:.2f} s; {row['check_shared_blocks_s']:.2f} / "
                f"{row['check_whole_files_one_thread_s']:.2f} s; {two['2']['wall_s']:.2f} / {two['1']['wall_s']:.2f} s "
                f"| hashing off the loop; checking shared |")
    battery = load("fault_battery")
    if battery:
        lines.append(f"| 16. fault battery (`benchmarks/fault_battery.py`): kills, damaged checkpoints, a full disk, signals, "
                     f"two runs in one directory, damaged data, `launch` | {battery['passed']} of {battery['cases']} "
                     f"cases pass; {battery['lost_checkpoints']} committed checkpoints lost | all; 0 |")
    loading = load("hf_load")
    if loading:
        lines.append(f"| 17. loading a Hugging Face checkpoint of {loading['parameters'] / 1e9:.2f}B parameters "
                     f"({loading['files_bytes'] / 1e9:.2f} GB of bf16 safetensors) FSDP over 8 CPU devices: host memory "
                     f"the loader adds beyond the loaded state, in largest tensors ({loading['largest_tensor_bytes'] / 1e6:.0f}"
                     f" MB as float32); load / raw read throughput | {loading['added_over_largest_tensor']:.2f} "
                     f"({loading['added_rss_bytes'] / 1e6:.0f} MB); {loading['load_gb_per_s']:.2f} / "
                     f"{loading['raw_gb_per_s']:.2f} GB/s | <= 2 tensors |")
    lora = load("lora")
    if lora:
        full, low = lora["full"], lora["lora"]
        lines.append(f"| 18. LoRA rank {lora['rank']} (all 7 projections) / full fine-tuning, {lora['parameters'] / 1e6:.1f}M "
                     f"parameters, {lora['strategy']} on {lora['mesh']} ({lora['machine']}): optimizer state per "
                     f"device; step time (median of interleaved steps); compiled scratch per device | "
                     f"{mb(low['optimizer_bytes_per_device'])} / {mb(full['optimizer_bytes_per_device'])} "
                     f"({100 * lora['optimizer_bytes_ratio']:.1f}%); {low['step_s']:.2f} / {full['step_s']:.2f} s "
                     f"({lora['step_time_ratio']:.2f}x); {mb(low['compiled_temp_bytes_per_device'])} / "
                     f"{mb(full['compiled_temp_bytes_per_device'])} | less |")
    generation = load("generation")
    if generation:
        speed = "; ".join(f"{row['new_tokens']}: {row['cache_tokens_per_s']:.0f} vs {row['recompute_tokens_per_s']:.1f} "
                          f"tok/s ({row['speedup']:.1f}x)" for row in generation["rows"] if "speedup" in row)
        flat = ", ".join(f"{row['model']} {row['step_vs_128']:.2f}x ({row['step_ms']:.1f} ms; bytes "
                         f"{row['bytes_vs_128']:.2f}x)" for row in generation["rows"] if "step_vs_128" in row)
        cache = generation["cache"]
        lines.append(f"| 19. decoding with the key/value cache, {generation['model']}, one prompt on one CPU device "
                     f"({generation['machine']}), greedy: tokens/s with the cache vs recomputing the prefix (same "
                     f"tokens), by new tokens; the decode step's time (median of the last 64) at 2,048 new tokens / "
                     f"at 128, beside the ratio of the bytes a step reads (weights, keys and values); the cache's "
                     f"bytes per device while decoding, {cache['batch']} rows x {cache['length']} positions on "
                     f"{cache['mesh']}, / 2 L B T kv_heads head_dim bytes / devices | {speed}; {flat}; "
                     f"{cache['ratio']:.3f} ({mb(cache['bytes_per_device'])}) | >= 10x at 512; <= 1.5x; 1 |")
    sample = {row["label"]: row for row in load("default_sample") or []}
    if "before" in sample and "after" in sample:
        before, after = sample["before"], sample["after"]

        def setting(row):
            return (f"{'BPE of ' + str(row['vocab']) + ' tokens' if row['tokenizer'] else 'bytes'}, batch "
                    f"{row['batch_size']} x {row['steps']} steps, temperature {row['temperature']:g}, top-k {row['top_k']}")

        def measured(row):
            return (f"{100 * row['word_share']:.1f}% ({100 * row['lowest']:.0f}-{100 * row['highest']:.0f}%), "
                    f"{row['wall_s']:.0f} s")

        gpt = sample.get(GPT_PRESETS)
        lines.append(f"| 20. the default `shardax train`: share of its samples' words found in the corpus (8 samples of "
                     f"200 tokens, pooled; single samples' range) and seconds to the end of training from an empty data "
                     f"cache ({after['machine']}): before ({setting(before)}) / "
                     + (f"{GPT_PRESETS} / " if gpt else "") + f"after ({setting(after)}, Llama-shaped tiny) | "
                     f"{measured(before)} / " + (f"{measured(gpt)}, validation {gpt['val_loss']:.3f} / " if gpt else "")
                     + f"{measured(after)}, validation {after['val_loss']:.3f} nats/token | more real words, about 90 s |")
    stress = load("simulated_stress")
    if stress:
        cells = _aborts(stress)
        first = load("simulated_stress_first")
        if first:
            cells += f"; before RMSNorm and SwiGLU had their own backward passes: {_aborts(first)}"
        lines.append(f"| 25. runs aborted in XLA:CPU's collectives, {stress['devices']} simulated devices beside a load "
                     f"of {stress['load processes']} busy processes on {stress['cores']} cores, XLA's default thread pool "
                     f"vs shardax's (`simulate_cpu_devices`) | {cells} | 0 with shardax's |")
    ema = load("ema")
    if ema:
        cells = "; ".join(f"{strategy}: {row['ema_bytes_ratio']:.3f}x the parameters' bytes, step "
                          f"{row['step_time_ratio']:.3f}x ({row['step_s_with'] * 1e3:.1f} vs "
                          f"{row['step_s_without'] * 1e3:.1f} ms)" for strategy, row in ema["strategies"].items())
        lines.append(f"| 26. a moving average of the weights (`ema_params({ema['decay']})`), Llama-style "
                     f"{ema['model']['d_model']}-wide, {ema['model']['n_layers']} layers, batch {ema['batch']}, on "
                     f"{ema['mesh']}: its bytes per device / the parameters', step time with / without (median of "
                     f"interleaved steps) | {cells} | dp 1x, zero2 1/8 (the optimizer state's share), fsdp 1x of its share; under 5% a step |")
    ema_gpu = load("ema_nvidia_h200")
    if ema_gpu:
        row = ema_gpu["strategies"]["dp"]
        lines.append(f"| 26. the same on {ema_gpu['machine']}: Llama-style {ema_gpu['model']['d_model']}-wide, "
                     f"{ema_gpu['model']['n_layers']} layers, vocabulary {ema_gpu['model']['vocab_size']} "
                     f"({row['param_bytes_per_device'] / 4e9:.2f}B parameters), batch {ema_gpu['batch']} x "
                     f"{ema_gpu['model']['seq_len']}, bfloat16 compute, dp | {row['ema_bytes_ratio']:.3f}x the "
                     f"parameters' bytes, step {row['step_time_ratio']:.3f}x ({row['step_s_with'] * 1e3:.1f} vs "
                     f"{row['step_s_without'] * 1e3:.1f} ms) | the average's read and write, about 1% a step |")
    lines += experts_rows(load("experts"))
    lines += user_experts_rows(load("user_experts"))
    lines += plan_init_from_rows(load("plan_init_from"))
    lines += post_training_rows(load("post_training"))
    for name, compiler in (("pipeline_held_out", "XLA:CPU"), ("pipeline_held_out_tpu_v5p_16", "XLA:TPU, v5p-16")):
        pipelines = load(name)
        if pipelines:
            ratios = [case["peak_ratio"] for case in pipelines["cases"]]
            close = sum(abs(r - 1) <= 0.05 for r in ratios)
            above = [case["peak_ratio"] for case in pipelines["cases"] if case["compiled_peak"] >= 300e6]
            heaps = compiler.startswith("XLA:TPU") and "estimated_peak" in pipelines["cases"][0]
            floor = f"; above 300 MB a chip: {', '.join(f'{r:.3f}' for r in above)}" if heaps else ""
            heap = " heap-based" if heaps else ""
            lines.append(f"| 2. plan's peak, predicted/compiled{heap} ({compiler}), pipeline steps never worked out "
                         f"on: {len(ratios)} shapes x pp/pp_fsdp/pp_tp, microbatches, a circular schedule | "
                         f"{min(ratios):.3f} to {max(ratios):.3f} ({close} of {len(ratios)} within 5%{floor}) | "
                         f"1 +- 0.05 |")
    for key, entry in (load("tpu_plan") or {}).items():
        rows = [row for row in entry["rows"] if "peak_gb" in row]

        def span(field, scale=1.0, digits=2):
            values = [scale * row[field] for row in rows if row.get(field)]
            return f"{min(values):.{digits}f}-{max(values):.{digits}f}" if values else "-"

        heaps = all("hbm_peak_gb" in row for row in rows)
        peaks = ", ".join((f"{row['strategy']} {row['hbm_peak_gb']:.2f} ({row['peak_gb']:.2f})" if heaps else
                           f"{row['strategy']} {row['peak_gb']:.2f}") if "peak_gb" in row else
                          f"{row['strategy']} does not fit" for row in entry["rows"])
        lines.append(f"| 21. {key} (batch {entry['batch_size']} x {entry['seq_len']}) compiled by XLA:TPU on this CPU "
                     f"host, {'every strategy' if len(entry['rows']) >= 10 else 'strategies that spread a 1b model'}: "
                     f"GB per chip{' as XLA:TPU allocates it (its memory analysis in brackets)' if heaps else ''}; "
                     f"collectives sent vs theory; XLA FLOPs vs 6 N tokens + "
                     f"attention; roofline MFU (upper bound); shardax's analytic peak vs XLA:TPU's"
                     f"{' heap-based one' if heaps else ''} | {peaks}; "
                     f"{span('sent_vs_theory')}x; {span('flops_vs_model', digits=3)}x; {span('mfu', 100, 1)}%; "
                     f"{span('predicted_vs_compiled')}x | all fit; within 5% of theory; ~1; -; within 5% above "
                     f"300 MB a chip |")
    decisions = load("tpu_decisions") or {}
    for key, rows in decisions.items():
        if "as shipped" not in rows:  # the select against the cond, per strategy
            ratios = [row["select_vs_cond"] for row in rows["rows"]]
            lines.append(f"| 22. {key}, small and a wide shallow model, dp/zero2/fsdp/tp/hsdp: the select's "
                         f"compiled peak vs the cond's | {min(ratios):.2f}-{max(ratios):.2f}x | select on TPUs "
                         f"(pipelines and XLA:CPU keep the cond) |")
            continue
        shipped = rows["as shipped"]
        parts = [f"{name.removeprefix('without ')}: peak {shipped['peak_bytes'] / 1e9:.3f} vs "
                 f"{row['peak_bytes'] / 1e9:.3f} GB, roofline {shipped['step_ms']:.3f} vs {row['step_ms']:.3f} ms"
                 for name, row in rows.items() if name != "as shipped"]
        lines.append(f"| 22. {key}, dp, bfloat16: choices made on XLA:CPU, as shipped vs undone, by XLA:TPU's compile "
                     f"| {'; '.join(parts)} | keep what helps |")
    mfu = load("mfu")
    if mfu:
        top = "; ".join(f"{row['jax_op'].split('/')[-1] or row['hlo_op']} {100 * row['share']:.1f}%"
                        for row in mfu.get("top_ops", []))
        others = "; ".join(f"remat {run['remat']}, batch {run['batch_size']}: {100 * run['mfu']:.1f}%"
                           for run in mfu.get("other_runs", []))
        blocks = "scanned" if mfu.get("scan_layers", True) else "in a Python loop"
        lines.append(f"| 7. MFU on one {mfu['machine']}, `{mfu['preset']}` in bf16, batch {mfu['batch_size']}, "
                     f"remat {mfu['remat']}, attention {mfu.get('attention', '?')}, blocks {blocks} ({mfu['formula']}) | "
                     f"{100 * mfu['mfu']:.1f}% ({mfu['tokens_per_s']:,.0f} tok/s, "
                     f"{mfu['model_flops_per_s'] / 1e12:.0f} TFLOP/s, peak {mfu['peak_bytes_in_use'] / 1e9:.1f} GB"
                     f"{'; ' + others if others else ''}; top ops, none over 6%: {top}) | >= 50% |")
    else:
        lines.append("| 7. MFU on one H100/H200 (`benchmarks/mfu.py`) | not measured: no GPU was lent to this task "
                     "| >= 50% |")
    lines.extend(gpu_decisions_rows(load("gpu_decisions")))
    aot = load("h100_aot")
    if aot:
        cases = [row for row in aot["cases"] if "real" in row]
        lines.append(f"| 23. `--target h100-1` (deviceless XLA:GPU) vs the real {aot['machine']}, {aot['strategy']}, "
                     f"{len(cases)} shapes (tiny..large): compiled peak, deviceless/real; XLA:GPU's own FLOPs / the "
                     f"model's; shardax's analytic peak / XLA:GPU's | "
                     f"{min(r['peak_ratio'] for r in cases):.3f}-{max(r['peak_ratio'] for r in cases):.3f}; "
                     f"{min(r['flops_ratio'] for r in cases):.4f}-{max(r['flops_ratio'] for r in cases):.3f} "
                     f"(cuBLAS and cuDNN calls uncounted); "
                     f"{min(r['analytic_peak_ratio'] for r in cases):.2f}-{max(r['analytic_peak_ratio'] for r in cases):.2f}x"
                     f" | 1; -; - |")
    machine = (overhead or comm or {}).get("machine", "unknown machine")
    return (f"Measured on: {machine}.\nReproduce with `python benchmarks/run_all.py`.\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-slow", action="store_true", help="skip the largest-model search, the plan-accuracy cases, the 512 MB data benchmark and the nnx.vmap compiles (minutes)")
    options = parser.parse_args()
    names = ["overhead", "memory_and_communication", "compile_time", "pipeline_bubble"] + (
        [] if options.skip_slow else ["largest_model", "plan_accuracy", "plan_held_out", "pipeline_held_out",
                                      "longest_sequence"])
    for name in names:
        run(["benchmarks/suite.py", name])
    run(["benchmarks/notebook_step_time.py"])
    run(["benchmarks/trainer_overhead.py"])
    run(["benchmarks/bpe_vs_bytes.py"])
    if not options.skip_slow:
        run(["benchmarks/lm_data.py"])
        run(["benchmarks/fault_battery.py"])
        run(["benchmarks/pipeline_vmap.py"])
    run(["benchmarks/layer_vjps.py"])
    run(["benchmarks/checkpoint_integrity.py"])
    run(["benchmarks/lora.py"])
    run(["benchmarks/ema.py"])
    run(["benchmarks/experts.py"])
    run(["benchmarks/post_training.py"])
    if not options.skip_slow:
        run(["benchmarks/hf_load.py"])
        run(["benchmarks/generation.py"])
    run(["benchmarks/default_sample.py", "after"])  # "before" and GPT_PRESETS ran on earlier checkouts
    if not options.skip_slow:
        run(["benchmarks/simulated_stress.py"])
    if importlib.util.find_spec("libtpu"):  # the tpu-plan extra: XLA:TPU compiles here, no TPU needed
        run(["benchmarks/tpu_plan.py", "--preset", "tiny", "--preset", "small"])
        run(["benchmarks/tpu_decisions.py"])
        run(["benchmarks/user_experts.py"])
        run(["benchmarks/plan_init_from.py"])
        run(["benchmarks/suite.py", "pipeline_held_out_tpu"])
    if has_gpu():
        run(["benchmarks/mfu.py"])
        run(["benchmarks/gpu_checks.py"])
        run(["benchmarks/ema.py", "--accelerator"])
    text = table()
    (RESULTS / "README.md").write_text(text)
    print(text)
