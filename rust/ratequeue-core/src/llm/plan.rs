//! What a call costs per unit before it is sent: its estimate spread over the units of
//! the limit it passes, each clamped to what that limit can ever grant.

use super::Defer;

/// Where a unit's cost comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitCost {
    /// One per call (`requests`, and any unit that does not follow the tokens).
    PerCall,
    /// Prompt + output tokens.
    Total,
    /// Prompt tokens.
    Input,
    /// Output tokens.
    Output,
}

impl UnitCost {
    /// The source of a unit's cost by its index in `(requests, tokens, input_tokens,
    /// output_tokens)`; any other index costs one per call.
    pub fn from_index(i: i64) -> Self {
        match i {
            1 => UnitCost::Total,
            2 => UnitCost::Input,
            3 => UnitCost::Output,
            _ => UnitCost::PerCall,
        }
    }
}

/// One unit of a call's plan: where its cost comes from and the most it may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitPlan {
    pub cost: UnitCost,
    /// The largest cost any route can admit (None: no clamp).
    pub clamp: Option<u64>,
}

impl UnitPlan {
    /// The unit's cost for an estimate of `input` prompt and `output` output tokens, and
    /// whether it was clamped; `Err(Defer)` when the total does not fit 64 bits.
    pub fn cost(&self, input: u64, output: u64) -> Result<(u64, bool), Defer> {
        let c = match self.cost {
            UnitCost::PerCall => 1,
            UnitCost::Total => input.checked_add(output).ok_or(Defer)?,
            UnitCost::Input => input,
            UnitCost::Output => output,
        };
        Ok(match self.clamp {
            Some(b) if c > b => (b, true),
            _ => (c, false),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_and_clamps() {
        let p = |i, clamp| UnitPlan {
            cost: UnitCost::from_index(i),
            clamp,
        };
        assert_eq!(p(0, None).cost(5, 7), Ok((1, false)));
        assert_eq!(p(-1, Some(0)).cost(5, 7), Ok((0, true)));
        assert_eq!(p(1, None).cost(5, 7), Ok((12, false)));
        assert_eq!(p(1, Some(10)).cost(5, 7), Ok((10, true)));
        assert_eq!(p(1, Some(12)).cost(5, 7), Ok((12, false)));
        assert_eq!(p(2, Some(4)).cost(5, 7), Ok((4, true)));
        assert_eq!(p(3, None).cost(5, 7), Ok((7, false)));
        assert_eq!(p(1, None).cost(u64::MAX, 1), Err(Defer));
        assert_eq!(p(2, None).cost(u64::MAX, 1), Ok((u64::MAX, false)));
    }
}
