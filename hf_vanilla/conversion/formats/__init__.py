"""The formats the converters read and write, as data: key tables, config mappings, reference classes and
refusals. encoder.py and seq2seq.py describe the two kinds (a BERT-family encoder, an encoder-decoder) and the steps
the one flow (conversion/flow.py) asks of a format; bert.py, roberta.py, distilbert.py, electra.py, marian.py and
bart.py fill them in; bert2bert.py reads transformers' EncoderDecoderModel and warm-starts one from a BERT;
fairseq.py holds the layout BART and Marian share. Each builds through the one map -> build step
(building.map_and_build), both ways. A format imports the machinery below it (mapping, building, parity, io), never
the flow or the command line; the registry of conversions (commands.py) names it for both."""
