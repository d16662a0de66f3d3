"""Simulator vs real runs: does ``pipetrain.simulate`` predict what ``pipetrain.train`` measures?

    python benchmarks/sim_vs_real.py            # ~6 min on 2 quiet cores; writes docs/sim_vs_real_*.png
    python benchmarks/sim_vs_real.py --quick    # ~2 min, no PNGs unless --png-dir is given
    python benchmarks/sim_vs_real.py --smoke    # a tiny model, under a minute: the script end to end

The parts live in ``benchmarks/simreal/`` (its ``__init__`` says what each step measures and why).
Results and their explanation: BENCHMARKS.md, "Simulator vs real runs".
"""
from simreal.main import main

if __name__ == "__main__":
    main()
