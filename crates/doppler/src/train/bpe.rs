//! Byte-level BPE (GPT-2 style) trained on the corpus with Hugging Face's `tokenizers`:
//! bytes map to 256 printable symbols, merges are learned up to the vocabulary size, and
//! `<|endoftext|>` is reserved. Training is deterministic for a given text.

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    TokenizerBuilder,
};

use crate::error::{Error, Result};

pub const END_OF_TEXT: &str = "<|endoftext|>";

fn err(e: impl std::fmt::Display) -> Error {
    Error::Invalid {
        op: "bpe tokenizer",
        detail: e.to_string(),
    }
}

pub fn train(text: &str, vocab_size: usize) -> Result<tokenizers::Tokenizer> {
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
        .build();
    let mut tk = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_normalizer(None)
    .with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(
        ByteLevel::default().add_prefix_space(false),
    )))
    .with_post_processor(None)
    .with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())))
    .build()
    .map_err(err)?;
    // One training "sequence" per line keeps the pre-tokenizer's work small.
    tk.train(&mut trainer, text.lines().map(|l| format!("{l}\n")))
        .map_err(err)?;
    Ok(tokenizers::Tokenizer::from(tk))
}

#[cfg(test)]
mod tests {
    #[test]
    fn trains_round_trips_and_is_deterministic() {
        let text = "the quick brown fox jumps over the lazy dog\n".repeat(50) + "thé naïve café\n";
        let a = super::train(&text, 300).unwrap();
        let b = super::train(&text, 300).unwrap();
        assert_eq!(a.to_string(false).unwrap(), b.to_string(false).unwrap());
        let ids = a.encode("the lazy café", false).unwrap().get_ids().to_vec();
        assert!(ids.len() < "the lazy café".len());
        assert_eq!(a.decode(&ids, false).unwrap(), "the lazy café");
    }
}
