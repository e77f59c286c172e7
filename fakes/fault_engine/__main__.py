from fakes.fault_engine.cli import main

main()
