from train import interrupt
from train.main import main

if __name__ == "__main__":  # spawned data workers import this module too; they must not train
  interrupt.exit_process(main())
