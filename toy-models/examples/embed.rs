//! Sentence embeddings from a GGUF model, and which sentences are close.
//!
//! ```sh
//! cargo run --release -p toy-models --example embed -- MODEL.gguf
//! ```
//!
//! `CausalLm::embed` averages the model's final hidden states over a text's tokens and scales
//! the mean to unit length (what `toy serve`'s `/v1/embeddings` returns), so a dot product of two
//! vectors is their cosine similarity. A chat model is not trained for retrieval: these vectors
//! tell "same topic" from "other topic", not much finer.

use toy_core::gguf::GgufFile;
use toy_core::tokenizer::Tokenizer;
use toy_models::{CausalLm, load_model};

const SENTENCES: [&str; 4] = [
    "The cat sat on the mat.",
    "A kitten is sleeping on the rug.",
    "Stock markets fell sharply on Monday.",
    "Shares dropped as investors sold.",
];

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: embed MODEL.gguf"))?;
    let file = GgufFile::open(&path)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let (_, model) = load_model::<burn::backend::Flex>(&file, &Default::default(), |_, _| {})?;

    let vectors = SENTENCES
        .iter()
        .map(|s| Ok(model.embed(&tokenizer.encode(s, true, false)?)?))
        .collect::<anyhow::Result<Vec<Vec<f32>>>>()?;
    let cosine = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();

    println!("{} dimensions; cosine similarities:", vectors[0].len());
    for (i, a) in vectors.iter().enumerate() {
        let row: Vec<String> = vectors
            .iter()
            .map(|b| format!("{:5.2}", cosine(a, b)))
            .collect();
        println!("  {}  {}", row.join(" "), SENTENCES[i]);
    }
    // Each sentence's nearest other one should be its pair (0-1, 2-3).
    for (i, a) in vectors.iter().enumerate() {
        let nearest = (0..vectors.len())
            .filter(|&j| j != i)
            .max_by(|&j, &k| cosine(a, &vectors[j]).total_cmp(&cosine(a, &vectors[k])))
            .unwrap();
        println!("nearest to {:?}: {:?}", SENTENCES[i], SENTENCES[nearest]);
    }
    Ok(())
}
