"""The converters' input and output: reading a source checkpoint without running its code (reading.py), writing a
converted one (writing.py), and placing the output folder whole or not at all (output.py). Below everything else in
the conversion package: of it, these modules import only each other and `errors`."""
