from fakes.sglang_emulator.cli import main

main()
