//! Choosing the next token from the logits, as llama.cpp's default sampler chain does:
//! penalties → top-k → top-p → min-p → temperature → a seeded random draw. A temperature of zero
//! or less means greedy decoding (argmax, ties to the lowest id — what the llama.cpp oracle does).
//!
//! Also [`StopStrings`], which decides when generated text has reached a stop string and how much
//! of it can be shown before then.
//!
//! The random draw uses xoshiro256** seeded with SplitMix64, written out here so that a seed gives
//! the same tokens on every platform and every version of toy (the algorithm behind `rand`'s
//! `StdRng` may change between releases). It cannot reproduce llama.cpp's draws, which come from
//! C++'s `std::mt19937` and `std::discrete_distribution`; only greedy decoding is comparable
//! token for token.

use std::collections::HashMap;

/// Sampling settings. `Default` is llama.cpp's defaults (`common_params_sampling`), with a fixed
/// seed.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Divide the logits by this before the draw; `<= 0` means greedy (argmax). Default 0.8.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `<= 0` keeps all. Default 40.
    pub top_k: i32,
    /// Keep the smallest set of most likely tokens whose probability adds up to at least
    /// `top_p`; `>= 1` keeps all. Default 0.95.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; `<= 0` keeps all.
    /// Default 0.05.
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of tokens seen in the last
    /// `repeat_last_n` tokens by this; 1 is off. Default 1.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalties look at; 0 turns them off, -1 means all of the
    /// history. Default 64.
    pub repeat_last_n: i32,
    /// Subtracted once from the logit of every token seen in the window. Default 0.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it appears in the window. Default 0.
    pub frequency_penalty: f32,
    /// Seed of the random draw. The default is fixed (0), so that a run is reproducible unless
    /// a seed is chosen; llama.cpp draws a random one, which callers do by passing one (the CLI
    /// uses the clock).
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding, every other setting off.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }

    /// Whether these settings decode greedily: a temperature of zero or less, or NaN.
    pub fn is_greedy(&self) -> bool {
        // `!(t > 0)` so that NaN counts as greedy too.
        self.temperature.is_nan() || self.temperature <= 0.0
    }
}

/// xoshiro256** (Blackman & Vigna), seeded by SplitMix64.
#[derive(Debug, Clone)]
struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    fn seed_from(seed: u64) -> Self {
        let mut x = crate::rng::SplitMix64::new(seed);
        Self {
            s: [x.next_u64(), x.next_u64(), x.next_u64(), x.next_u64()],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Picks tokens from logits with [`SamplingParams`]. Holds the random state: one sampler per
/// generated sequence.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Xoshiro256,
}

impl Sampler {
    /// A sampler whose random draws are seeded by `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        Self {
            rng: Xoshiro256::seed_from(params.seed),
            params,
        }
    }

    /// The settings it samples with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Choose the next token. `history` is the sequence so far (prompt and generated tokens),
    /// which the repetition penalties read. NaN logits count as impossible; an empty `logits`
    /// returns 0.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if logits.is_empty() {
            return 0;
        }
        let mut logits: Vec<f32> = logits
            .iter()
            .map(|&l| if l.is_nan() { f32::NEG_INFINITY } else { l })
            .collect();
        self.apply_penalties(&mut logits, history);

        if self.params.is_greedy() {
            return argmax(&logits);
        }

        let p = &self.params;
        // Candidates, most likely first (ties: lowest id first, so the order is reproducible).
        let mut cands: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && (p.top_k as usize) < cands.len() {
            let k = p.top_k as usize;
            cands.select_nth_unstable_by(k - 1, by_logit);
            cands.truncate(k);
        }
        cands.sort_unstable_by(by_logit);

        // top-p and min-p look at the probabilities before temperature, as in llama.cpp's chain.
        if p.top_p < 1.0 {
            let probs = softmax(&cands, 1.0);
            let mut cum = 0.0;
            let mut keep = cands.len();
            for (i, pr) in probs.iter().enumerate() {
                cum += pr;
                if cum >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            cands.truncate(keep.max(1));
        }
        if p.min_p > 0.0 {
            let max = cands[0].1;
            let threshold = max + p.min_p.ln();
            let keep = cands.iter().take_while(|c| c.1 >= threshold).count();
            cands.truncate(keep.max(1));
        }

        let probs = softmax(&cands, p.temperature);
        let r = self.rng.next_f64();
        let mut cum = 0.0;
        for (c, pr) in cands.iter().zip(&probs) {
            cum += pr;
            if r < cum {
                return c.0;
            }
        }
        // Rounding left `cum` a hair under 1: the last candidate with any probability.
        cands
            .iter()
            .zip(&probs)
            .rev()
            .find(|(_, pr)| **pr > 0.0)
            .map_or(cands[0].0, |(c, _)| c.0)
    }

    /// llama.cpp's penalties sampler: repetition (divide/multiply), frequency and presence.
    fn apply_penalties(&self, logits: &mut [f32], history: &[u32]) {
        let p = &self.params;
        let active =
            p.repeat_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
        if !active || p.repeat_last_n == 0 || history.is_empty() {
            return;
        }
        let window = if p.repeat_last_n < 0 {
            history
        } else {
            &history[history.len().saturating_sub(p.repeat_last_n as usize)..]
        };
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &t in window {
            *counts.entry(t).or_default() += 1;
        }
        for (&t, &n) in &counts {
            let Some(l) = logits.get_mut(t as usize) else {
                continue;
            };
            if *l <= 0.0 {
                *l *= p.repeat_penalty;
            } else {
                *l /= p.repeat_penalty;
            }
            *l -= n as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }
}

/// Index of the largest logit; ties go to the lowest id.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Probabilities of sorted candidates at a temperature, in f64.
fn softmax(cands: &[(u32, f32)], temperature: f32) -> Vec<f64> {
    let t = temperature as f64;
    let max = cands
        .iter()
        .map(|c| c.1 as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        // Every candidate impossible: fall back to uniform rather than NaN.
        return vec![1.0 / cands.len() as f64; cands.len()];
    }
    let exps: Vec<f64> = cands
        .iter()
        .map(|c| ((c.1 as f64 - max) / t).exp())
        .collect();
    let sum: f64 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

/// What [`StopStrings::check`] says about the text generated so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopStatus {
    /// No stop string yet. `text[..emit_upto]` can be shown; the rest could still turn out to
    /// be the start of a stop string.
    Continue {
        /// Bytes of the text that can be shown.
        emit_upto: usize,
    },
    /// Stop string number `stop` appeared; the answer is `text[..emit_upto]` (the stop string
    /// itself is not part of it).
    Stop {
        /// Bytes of the text before the stop string.
        emit_upto: usize,
        /// Index of the stop string that matched.
        stop: usize,
    },
}

/// Stop strings (OpenAI's `stop`, llama.cpp's antiprompts) checked against generated text.
///
/// Two ways to use it: [`check`](Self::check) looks at the whole text so far and says where it
/// ends; [`push`](Self::push)/[`finish`](Self::finish) take the text piece by piece as a stream
/// and return what can be shown now.
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    /// Streamed text not yet returned: it could still be the start of a stop string.
    held: String,
    stopped: bool,
}

impl StopStrings {
    /// Empty strings are ignored (they would match everywhere).
    pub fn new<S: Into<String>>(stops: impl IntoIterator<Item = S>) -> Self {
        let stops = stops
            .into_iter()
            .map(Into::into)
            .filter(|s: &String| !s.is_empty())
            .collect();
        Self {
            stops,
            held: String::new(),
            stopped: false,
        }
    }

    /// Streaming: add the next piece of generated text. Returns the text that can be shown now
    /// and whether a stop string has appeared (then generation should end, and the returned text
    /// is everything before the stop string). After a stop, further pieces return nothing.
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        // A stop string cannot start inside text already returned: that text was only returned
        // because no stop string could start there. So looking at the held text is enough.
        self.held.push_str(piece);
        match self.check(&self.held) {
            StopStatus::Stop { emit_upto, .. } => {
                self.stopped = true;
                let out = self.held[..emit_upto].to_string();
                self.held.clear();
                (out, true)
            }
            StopStatus::Continue { emit_upto } => {
                let out = self.held[..emit_upto].to_string();
                self.held.drain(..emit_upto);
                (out, false)
            }
        }
    }

    /// Streaming: the generation ended (end of generation, length limit) with `piece` as the
    /// last text. Returns all the text still to show: held-back text was not a stop string after
    /// all.
    pub fn finish(&mut self, piece: &str) -> String {
        let (mut out, stopped) = self.push(piece);
        if !stopped {
            out.push_str(&self.held);
        }
        self.held.clear();
        self.stopped = true;
        out
    }

    /// Whether a stop string has appeared in the streamed text.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Whether there are no (non-empty) stop strings, so nothing can stop generation.
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// The stop strings, in the order given, without empty ones.
    pub fn strings(&self) -> &[String] {
        &self.stops
    }

    /// Look at all the text generated so far. The earliest stop string wins; at one position
    /// the first listed wins.
    pub fn check(&self, text: &str) -> StopStatus {
        let first = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| text.find(s.as_str()).map(|at| (at, i)))
            .min();
        if let Some((at, stop)) = first {
            return StopStatus::Stop {
                emit_upto: at,
                stop,
            };
        }
        // Hold back the longest end of `text` that is a proper prefix of a stop string.
        let hold = self
            .stops
            .iter()
            .filter_map(|s| {
                (1..s.len())
                    .rev()
                    .filter(|&k| s.is_char_boundary(k))
                    .find(|&k| text.ends_with(&s[..k]))
            })
            .max()
            .unwrap_or(0);
        StopStatus::Continue {
            emit_upto: text.len() - hold,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::greedy();
        p.temperature = 1.0;
        p.seed = 42;
        f(&mut p);
        p
    }

    /// Draw `n` tokens and count how often each id comes out.
    fn histogram(p: SamplingParams, logits: &[f32], n: usize) -> Vec<usize> {
        let mut s = Sampler::new(p);
        let mut h = vec![0; logits.len()];
        for _ in 0..n {
            h[s.sample(logits, &[]) as usize] += 1;
        }
        h
    }

    #[test]
    fn defaults_are_llama_cpp_defaults() {
        let d = SamplingParams::default();
        assert_eq!(
            (d.temperature, d.top_k, d.top_p, d.min_p),
            (0.8, 40, 0.95, 0.05)
        );
        assert_eq!((d.repeat_penalty, d.repeat_last_n), (1.0, 64));
        assert!(!d.is_greedy());
        assert!(SamplingParams::greedy().is_greedy());
    }

    #[test]
    fn greedy_is_argmax_with_ties_to_lowest_id() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0, 2.9], &[]), 1);
        assert_eq!(s.sample(&[5.0, 5.0], &[]), 0);
        assert_eq!(s.sample(&[f32::NAN, -1.0, f32::NEG_INFINITY], &[]), 1);
        // Negative temperature is greedy too.
        let mut s = Sampler::new(params(|p| p.temperature = -1.0));
        assert_eq!(s.sample(&[0.0, 0.5, 0.2], &[]), 1);
        assert_eq!(Sampler::new(SamplingParams::greedy()).sample(&[], &[]), 0);
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits = [0.3, 1.7, 1.69, -2.0, 1.0];
        let mut s = Sampler::new(params(|p| {
            p.top_k = 1;
            p.temperature = 5.0;
        }));
        for _ in 0..200 {
            assert_eq!(s.sample(&logits, &[]), 1);
        }
    }

    #[test]
    fn top_k_keeps_only_the_k_best() {
        let logits = [1.0, 4.0, 3.0, 2.0, 0.0];
        let h = histogram(params(|p| p.top_k = 2), &logits, 4000);
        assert_eq!(h[0] + h[3] + h[4], 0, "{h:?}");
        assert!(h[1] > 0 && h[2] > 0);
    }

    #[test]
    fn top_p_keeps_the_minimal_nucleus() {
        // Probabilities 0.5, 0.25, 0.125, 0.125 (logits are log-probabilities).
        let logits = [0.5f32.ln(), 0.25f32.ln(), 0.125f32.ln(), 0.125f32.ln()];
        // 0.5 + 0.25 = 0.75 >= 0.7: tokens 0 and 1 only, in ratio 2:1.
        let h = histogram(params(|p| p.top_p = 0.7), &logits, 6000);
        assert_eq!(h[2] + h[3], 0, "{h:?}");
        let ratio = h[0] as f64 / h[1] as f64;
        assert!((ratio - 2.0).abs() < 0.25, "{h:?}");
        // 0.5 reaches 0.5 exactly: the single most likely token.
        let h = histogram(params(|p| p.top_p = 0.5), &logits, 500);
        assert_eq!(h[0], 500, "{h:?}");
        // 0.76 needs the third token.
        let h = histogram(params(|p| p.top_p = 0.76), &logits, 6000);
        assert!(h[2] > 0 || h[3] > 0, "{h:?}");
        assert_eq!(
            h[2].min(h[3]),
            0,
            "only one of the tied third tokens fits: {h:?}"
        );
    }

    #[test]
    fn min_p_threshold_is_relative_to_the_best() {
        // Probabilities proportional to 1, 0.5, 0.2, 0.09.
        let logits = [0.0, 0.5f32.ln(), 0.2f32.ln(), 0.09f32.ln()];
        let h = histogram(params(|p| p.min_p = 0.1), &logits, 5000);
        assert_eq!(h[3], 0, "0.09 < 0.1 × 1: {h:?}");
        assert!(h[2] > 0, "0.2 >= 0.1 × 1 survives: {h:?}");
        let h = histogram(params(|p| p.min_p = 0.6), &logits, 500);
        assert_eq!(h[0], 500, "{h:?}");
    }

    #[test]
    fn repeat_penalty_changes_the_argmax() {
        let logits = [2.0, 1.5, -1.0];
        let mut s = Sampler::new(params(|p| {
            p.temperature = 0.0;
            p.repeat_penalty = 1.5;
            p.repeat_last_n = 4;
        }));
        // 2.0 / 1.5 = 1.33 < 1.5: token 1 wins once token 0 was seen.
        assert_eq!(s.sample(&logits, &[0]), 1);
        // Outside the window (last 4 tokens) the penalty does not apply.
        assert_eq!(s.sample(&logits, &[0, 2, 2, 2, 2]), 0);
        // A negative logit is multiplied: -1.0 × 1.5 makes token 2 less likely, not more.
        let mut s = Sampler::new(params(|p| {
            p.temperature = 0.0;
            p.repeat_penalty = 1.5;
            p.repeat_last_n = -1;
        }));
        assert_eq!(s.sample(&[-1.0, -1.2], &[0]), 1);
        // Off when repeat_last_n is 0.
        let mut s = Sampler::new(params(|p| {
            p.temperature = 0.0;
            p.repeat_penalty = 1.5;
        }));
        assert_eq!(s.sample(&[-1.0, -1.2], &[0]), 0);
    }

    #[test]
    fn frequency_and_presence_penalties() {
        let logits = [3.0, 2.0];
        let greedy = |f: fn(&mut SamplingParams)| {
            let mut p = SamplingParams::greedy();
            p.repeat_last_n = 64;
            f(&mut p);
            Sampler::new(p)
        };
        // Presence: -1.5 once, however often token 0 appeared: 1.5 < 2.
        assert_eq!(
            greedy(|p| p.presence_penalty = 1.5).sample(&logits, &[0]),
            1
        );
        assert_eq!(
            greedy(|p| p.presence_penalty = 0.5).sample(&logits, &[0, 0, 0]),
            0
        );
        // Frequency: -0.4 per occurrence: 3 − 0.8 = 2.2 > 2 after two, 3 − 1.2 = 1.8 after three.
        assert_eq!(
            greedy(|p| p.frequency_penalty = 0.4).sample(&logits, &[0, 0]),
            0
        );
        assert_eq!(
            greedy(|p| p.frequency_penalty = 0.4).sample(&logits, &[0, 0, 0]),
            1
        );
        // Ids outside the logits (a bad history) are ignored, not a panic.
        assert_eq!(
            greedy(|p| p.presence_penalty = 9.0).sample(&logits, &[77]),
            0
        );
    }

    #[test]
    fn same_seed_same_sequence() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let draw = |seed| {
            let mut s = Sampler::new(params(|p| {
                p.seed = seed;
                p.top_k = 0;
            }));
            (0..64).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn xoshiro_reference_values() {
        // Pin the generator so a refactor cannot silently change seeded outputs.
        let mut r = Xoshiro256::seed_from(0);
        let first: Vec<u64> = (0..3).map(|_| r.next_u64()).collect();
        let mut again = Xoshiro256::seed_from(0);
        assert_eq!(first, (0..3).map(|_| again.next_u64()).collect::<Vec<_>>());
        // SplitMix64(0) first output, the published reference value.
        let x = Xoshiro256::seed_from(0);
        assert_eq!(x.s[0], 0xE220_A839_7B1D_CDAF);
        assert!((0..1000).all(|_| (0.0..1.0).contains(&r.next_f64())));
    }

    #[test]
    fn draws_follow_the_distribution() {
        // p = softmax([ln 0.6, ln 0.3, ln 0.1]) = 0.6, 0.3, 0.1.
        let logits = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()];
        let n = 20000;
        let h = histogram(params(|_| {}), &logits, n);
        for (count, want) in h.iter().zip([0.6, 0.3, 0.1]) {
            let got = *count as f64 / n as f64;
            // 4 standard deviations of a binomial proportion.
            let tol = 4.0 * (want * (1.0 - want) / n as f64).sqrt();
            assert!((got - want).abs() < tol, "{h:?}");
        }
        // Temperature 0.5 squares the ratios: 0.36 : 0.09 : 0.01.
        let h = histogram(params(|p| p.temperature = 0.5), &logits, n);
        let got = h[0] as f64 / n as f64;
        assert!((got - 0.36 / 0.46).abs() < 0.02, "{h:?}");
    }

    #[test]
    fn stop_strings_hold_back_possible_starts() {
        let stops = StopStrings::new(["</answer>", "\n\nUser:", ""]);
        assert_eq!(stops.strings().len(), 2);
        assert_eq!(stops.check("Hello"), StopStatus::Continue { emit_upto: 5 });
        // "</an" could become "</answer>": hold 4 bytes.
        assert_eq!(
            stops.check("Hello </an"),
            StopStatus::Continue { emit_upto: 6 }
        );
        assert_eq!(
            stops.check("Hello\n"),
            StopStatus::Continue { emit_upto: 5 }
        );
        assert_eq!(
            stops.check("Hello\n\nUser"),
            StopStatus::Continue { emit_upto: 5 }
        );
        assert_eq!(
            stops.check("42</answer> trailing"),
            StopStatus::Stop {
                emit_upto: 2,
                stop: 0
            }
        );
        // The earliest occurrence wins.
        assert_eq!(
            stops.check("a\n\nUser: b</answer>"),
            StopStatus::Stop {
                emit_upto: 1,
                stop: 1
            }
        );
        // Multi-byte: a held suffix never splits a character.
        let stops = StopStrings::new(["né!"]);
        assert_eq!(stops.check("un né"), StopStatus::Continue { emit_upto: 3 });
        assert_eq!(
            stops.check("un né!"),
            StopStatus::Stop {
                emit_upto: 3,
                stop: 0
            }
        );
        assert!(StopStrings::new(Vec::<String>::new()).is_empty());
        assert_eq!(
            StopStrings::default().check("x"),
            StopStatus::Continue { emit_upto: 1 }
        );
    }

    #[test]
    fn stop_strings_streaming() {
        let mut stops = StopStrings::new(["</answer>"]);
        assert_eq!(
            stops.push("The answer is 4"),
            ("The answer is 4".to_string(), false)
        );
        assert_eq!(stops.push(".</"), (".".to_string(), false));
        assert_eq!(stops.push("ans"), (String::new(), false));
        assert_eq!(stops.push("wer> and more"), (String::new(), true));
        assert!(stops.stopped());
        assert_eq!(stops.push("ignored"), (String::new(), true));
        assert_eq!(stops.finish("x"), "");

        // A false start is released when it stops matching, and at the end.
        let mut stops = StopStrings::new(["</answer>"]);
        assert_eq!(stops.push("a </an"), ("a ".to_string(), false));
        assert_eq!(stops.push("t>"), ("</ant>".to_string(), false));
        assert_eq!(stops.push(" </answ"), (" ".to_string(), false));
        assert_eq!(stops.finish(""), "</answ");

        // The stop string split across many pieces, and text after it in the same piece.
        let mut stops = StopStrings::new(["STOP", "\n\n"]);
        let mut shown = String::new();
        for piece in ["ab", "S", "T", "x S", "TO", "P!", "more"] {
            let (out, stop) = stops.push(piece);
            shown.push_str(&out);
            if stop {
                break;
            }
        }
        assert_eq!(shown, "abSTx ");
    }
}
