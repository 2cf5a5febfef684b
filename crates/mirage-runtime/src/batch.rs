//! Continuous batching: several sequences share every forward pass.
//!
//! A [`Batcher`] owns one KV cache with a sequence slot per concurrent
//! request. Each [`Batcher::step`] runs one forward pass whose rows are the
//! pending token of every decoding sequence plus a chunk of the prompt of
//! sequences still in prefill (each row carries its own [`TokenSlot`]), then
//! samples the next token of every sequence whose prompt is fully in the
//! cache. Sequences join with [`Batcher::add`] and leave with
//! [`Batcher::cancel`] or when they finish, between steps, so a new request
//! never waits for the others to end.
//!
//! Sampling, stop strings and streamed detokenization follow
//! [`crate::Session::generate_from`], so a greedy sequence produces the same
//! tokens alone or in a batch.

use std::time::Instant;

use mirage_tokenizer::StreamDecoder;

use crate::backend::{Backend, TokenSlot};
use crate::engine::{sample_next, ActiveConstraint, Engine, GenerateParams, StopReason};
use crate::error::{Result, RuntimeError};
use crate::model::Scratch;
use crate::sampling::{token_logprob, Sampler, StopCheck, StopStrings, TokenLogprob};

/// What one [`Batcher::step`] produced for one sequence slot.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// New text of the sequence in `slot` (stop strings held back until
    /// they cannot match any more).
    Text {
        /// The sequence slot.
        slot: usize,
        /// The text piece.
        text: String,
    },
    /// The log-probability of the token the sequence in `slot` just
    /// sampled (only when its [`GenerateParams::logprobs`] asked), sent
    /// before the text that token completes; one per generated token, in
    /// order.
    Logprob {
        /// The sequence slot.
        slot: usize,
        /// The token, its log-probability and the top alternatives.
        logprob: TokenLogprob,
    },
    /// The sequence in `slot` ended and its slot is free again.
    Finished {
        /// The sequence slot.
        slot: usize,
        /// Why it ended.
        reason: StopReason,
        /// Tokens of its prompt.
        prompt_tokens: usize,
        /// Tokens it generated (end-of-generation token excluded).
        completion_tokens: usize,
    },
}

/// Counts of one [`Batcher::step`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// Rows in the forward pass (decode rows plus prompt rows).
    pub rows: usize,
    /// Sequences that decoded one token in this pass.
    pub decode_rows: usize,
    /// Prompt tokens run in this pass.
    pub prompt_rows: usize,
    /// Tokens sampled in this step.
    pub sampled: usize,
    /// Seconds of the forward pass and sampling.
    pub secs: f64,
}

struct Sequence {
    /// Prompt then generated tokens; `context[..fed]` is in the cache.
    context: Vec<u32>,
    fed: usize,
    prompt_len: usize,
    max_tokens: usize,
    sampler: Sampler,
    constraint: Option<ActiveConstraint>,
    logprobs: Option<usize>,
    stops: StopStrings,
    decoder: StreamDecoder,
    text: String,
    emitted: usize,
    generated: usize,
}

/// Runs many sequences through one model, one shared forward pass per step.
pub struct Batcher<'e, B: Backend> {
    engine: &'e Engine<B>,
    cache: B::KvCache,
    scratch: Scratch<B>,
    logits: Vec<f32>,
    seqs: Vec<Option<Sequence>>,
    max_rows: usize,
}

impl<B: Backend> std::fmt::Debug for Batcher<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("slots", &self.seqs.len())
            .field("active", &self.active())
            .finish()
    }
}

impl<'e, B: Backend> Batcher<'e, B> {
    /// A batcher with `max_seqs` sequence slots of [`Engine::n_ctx`]
    /// positions each, running at most `max_rows` rows per forward pass
    /// (decode rows always run; prompts fill what is left, at least one row).
    pub fn new(engine: &'e Engine<B>, max_seqs: usize, max_rows: usize) -> Result<Batcher<'e, B>> {
        if max_seqs == 0 {
            return Err(RuntimeError::InvalidArgument(
                "a batcher needs at least one sequence slot".into(),
            ));
        }
        let o = engine.options();
        let cache = engine.model().new_kv_cache_pruned(
            engine.n_ctx(),
            max_seqs,
            o.kv_dtype,
            o.kv_pruning,
        )?;
        Ok(Batcher {
            engine,
            cache,
            scratch: engine.model().new_scratch(),
            logits: Vec::new(),
            seqs: (0..max_seqs).map(|_| None).collect(),
            max_rows: max_rows.max(1),
        })
    }

    /// Sequence slots in all.
    pub fn capacity(&self) -> usize {
        self.seqs.len()
    }

    /// Slots holding a sequence.
    pub fn active(&self) -> usize {
        self.seqs.iter().filter(|s| s.is_some()).count()
    }

    /// Slots free for [`Batcher::add`].
    pub fn free_slots(&self) -> usize {
        self.capacity() - self.active()
    }

    /// Whether `slot` holds a sequence.
    pub fn is_active(&self, slot: usize) -> bool {
        matches!(self.seqs.get(slot), Some(Some(_)))
    }

    /// Starts a sequence generating after `prompt` and returns its slot.
    /// Fails with [`RuntimeError::ContextFull`] when the prompt leaves no
    /// room for a token, and with [`RuntimeError::InvalidArgument`] for an
    /// empty prompt or when every slot is taken.
    pub fn add(&mut self, prompt: Vec<u32>, params: &GenerateParams) -> Result<usize> {
        params.validate()?;
        if prompt.is_empty() {
            return Err(RuntimeError::InvalidArgument("empty prompt".into()));
        }
        if prompt.len() >= self.engine.n_ctx() {
            return Err(RuntimeError::ContextFull {
                n_ctx: self.engine.n_ctx(),
            });
        }
        let slot =
            self.seqs.iter().position(|s| s.is_none()).ok_or_else(|| {
                RuntimeError::InvalidArgument("every sequence slot is busy".into())
            })?;
        let vocab = self.engine.model().config().vocab_size;
        let constraint = ActiveConstraint::start(params, vocab)?;
        self.engine
            .model()
            .backend()
            .kv_truncate(&mut self.cache, slot, 0);
        self.seqs[slot] = Some(Sequence {
            prompt_len: prompt.len(),
            context: prompt,
            fed: 0,
            max_tokens: params.max_tokens,
            sampler: Sampler::new(params.sampling.clone()),
            constraint,
            logprobs: params.logprobs,
            stops: StopStrings::new(params.stop.iter().cloned()),
            decoder: StreamDecoder::new(),
            text: String::new(),
            emitted: 0,
            generated: 0,
        });
        Ok(slot)
    }

    /// Drops the sequence in `slot` (a client went away); its slot is free
    /// for the next [`Batcher::add`]. Returns whether it held one.
    pub fn cancel(&mut self, slot: usize) -> bool {
        match self.seqs.get_mut(slot) {
            Some(s @ Some(_)) => {
                *s = None;
                self.engine
                    .model()
                    .backend()
                    .kv_truncate(&mut self.cache, slot, 0);
                true
            }
            _ => false,
        }
    }

    /// One forward pass over every active sequence, then sampling; appends
    /// what happened to `events`. Does nothing without active sequences.
    pub fn step(&mut self, events: &mut Vec<SeqEvent>) -> Result<StepStats> {
        let t0 = Instant::now();
        let n_ctx = self.engine.n_ctx();
        let mut tokens = Vec::new();
        let mut slots = Vec::new();
        // (slot, row of its last token) for sequences that sample this step.
        let mut sampling: Vec<usize> = Vec::new();
        let mut logits_rows = Vec::new();
        let mut stats = StepStats::default();
        // Decode rows first: one pending token per decoding sequence.
        for (i, s) in self.seqs.iter().enumerate() {
            let Some(s) = s else { continue };
            if s.fed >= s.prompt_len && s.fed < s.context.len() {
                logits_rows.push(tokens.len());
                sampling.push(i);
                slots.push(TokenSlot { seq: i, pos: s.fed });
                tokens.push(s.context[s.fed]);
                stats.decode_rows += 1;
            }
        }
        // Prompt chunks in the room that is left.
        let mut room = self.max_rows.saturating_sub(tokens.len()).max(1);
        let mut prefill: Vec<(usize, usize)> = Vec::new();
        for (i, s) in self.seqs.iter().enumerate() {
            let Some(s) = s else { continue };
            if room == 0 {
                break;
            }
            if s.fed < s.prompt_len {
                let n = (s.prompt_len - s.fed).min(room);
                for k in 0..n {
                    slots.push(TokenSlot {
                        seq: i,
                        pos: s.fed + k,
                    });
                    tokens.push(s.context[s.fed + k]);
                }
                if s.fed + n == s.prompt_len {
                    logits_rows.push(tokens.len() - 1);
                    sampling.push(i);
                }
                prefill.push((i, n));
                stats.prompt_rows += n;
                room -= n;
            }
        }
        if tokens.is_empty() {
            return Ok(stats);
        }
        stats.rows = tokens.len();
        let model = self.engine.model();
        model.forward(
            &tokens,
            &slots,
            &logits_rows,
            &mut self.cache,
            &mut self.scratch,
            &mut self.logits,
        )?;
        // Decoders advance by their one row (before the prompt chunks, whose
        // sequences do not pass the test until their prompt is all in).
        for s in self.seqs.iter_mut().flatten() {
            if s.fed >= s.prompt_len && s.fed < s.context.len() {
                s.fed += 1;
            }
        }
        for &(i, n) in &prefill {
            if let Some(s) = &mut self.seqs[i] {
                s.fed += n;
            }
        }
        let vocab = self.logits.len() / logits_rows.len().max(1);
        let tokenizer = self.engine.tokenizer();
        for (row, &i) in sampling.iter().enumerate() {
            let logits = &self.logits[row * vocab..(row + 1) * vocab];
            let Some(s) = self.seqs[i].as_mut() else {
                continue;
            };
            // A constraint that fails (or refuses its own pick) ends only
            // its sequence, as end of generation; the others go on.
            let sampled = sample_next(&mut s.sampler, logits, &s.context, s.constraint.as_mut())
                .ok()
                .flatten()
                .filter(|&t| {
                    tokenizer.is_eog(t) || s.constraint.as_mut().is_none_or(|c| c.accept(t).is_ok())
                });
            stats.sampled += 1;
            let mut finish = None;
            if let (Some(token), Some(n)) = (sampled, s.logprobs) {
                if !tokenizer.is_eog(token) {
                    events.push(SeqEvent::Logprob {
                        slot: i,
                        logprob: token_logprob(logits, token, n),
                    });
                }
            }
            let token = sampled.unwrap_or(0);
            if sampled.is_none_or(|t| tokenizer.is_eog(t)) {
                finish = Some(StopReason::EndOfGeneration);
            } else {
                s.generated += 1;
                s.context.push(token);
                s.text.push_str(&s.decoder.push_token(tokenizer, token));
                match s.stops.check(&s.text) {
                    StopCheck::Stop(at) => {
                        s.text.truncate(at);
                        finish = Some(StopReason::StopString);
                    }
                    StopCheck::Emit(safe) => {
                        if safe > s.emitted {
                            events.push(SeqEvent::Text {
                                slot: i,
                                text: s.text[s.emitted..safe].to_string(),
                            });
                            s.emitted = safe;
                        }
                    }
                }
                if finish.is_none() && s.generated >= s.max_tokens {
                    finish = Some(StopReason::MaxTokens);
                }
                // The next step feeds this token at position context.len() - 1.
                if finish.is_none() && s.context.len() > n_ctx {
                    finish = Some(StopReason::ContextFull);
                }
            }
            if let Some(reason) = finish {
                if reason != StopReason::StopString {
                    let tail = s.decoder.finish();
                    s.text.push_str(&tail);
                    // A stop string may complete only in the flushed tail.
                    if let StopCheck::Stop(at) = s.stops.check(&s.text) {
                        s.text.truncate(at);
                    }
                }
                if s.text.len() > s.emitted {
                    events.push(SeqEvent::Text {
                        slot: i,
                        text: s.text[s.emitted..].to_string(),
                    });
                }
                events.push(SeqEvent::Finished {
                    slot: i,
                    reason,
                    prompt_tokens: s.prompt_len,
                    completion_tokens: s.generated,
                });
                self.cancel(i);
            }
        }
        stats.secs = t0.elapsed().as_secs_f64();
        Ok(stats)
    }
}
