from thunderproxy.cli import main

main()
