"""A model bigger than one worker: can pipetrain train it, starting and saving it without ever holding
it whole, and is it no worse than torch.distributed.pipelining's own recipe?

    flock /tmp/pipetrain-bench.lock python benchmarks/big_model.py                # Llama 1.5B (~6 GiB)
    python benchmarks/big_model.py --size small --json big.json                  # 134M, minutes
    python benchmarks/big_model.py --size tiny                                   # seconds: the script end to end
    python benchmarks/big_model.py --largest tiny,small,1.5b,2.7b,7b             # the largest pipetrain trains

A Hugging Face ``LlamaForCausalLM`` of the size asked (``LlamaConfig``'s defaults otherwise, float32) is
built on the meta device and its initial weights written once as a sharded safetensors checkpoint, a
decoder layer at a time (reused if there). Then, on 4 workers of this machine, 4 stages of equal decoder
layer counts, ``1f1b-flush``, SGD, ``--updates`` updates of random tokens:

* pipetrain: ``weights=`` the checkpoint (each worker reads its stage's tensors), ``save=`` a directory
  (each stage writes its shard); then ``from_pretrained`` in a fresh process checks what was saved
  ([Note: the loss check] in ``bigmodel/ours.py``);
* torch: every rank builds the model on meta, keeps its layers as torchtitan splits a model by hand,
  ``to_empty``, reads its tensors with ``safe_open``, recomputes the rotary ``inv_freq``, and runs
  ``PipelineStage`` under ``Schedule1F1B`` (``bigmodel/torch_recipe.py``).

It prints per system and rank the peak memory (and pipetrain's prediction, where it makes one), the
seconds to load, to the first update and to save, and the verdict. Results: BENCHMARKS.md, "A model
bigger than one worker".
"""
from bigmodel.main import main

if __name__ == "__main__":
    main()
