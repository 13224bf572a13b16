//! The limiter's unit tests.

mod rates {
    use super::super::*;
    use crate::clock::ManualClock;
    use crate::wait::{GrantRef, Resource};
    use std::sync::Arc;

    fn limiter(rates: &[(&str, f64, u64)]) -> (Limiter, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(0).unwrap());
        let rates = rates
            .iter()
            .map(|(u, r, b)| (u.to_string(), Rate::new(*r, 1e9, *b).unwrap()))
            .collect();
        (Limiter::new(rates, AnyClock::Manual(clock.clone())).unwrap(), clock)
    }

    #[test]
    fn all_or_nothing_across_units() {
        let (l, _) = limiter(&[("requests", 10.0, 5), ("tokens", 100.0, 100)]);
        assert!(l.try_acquire(&[1, 90]).is_ok());
        assert!(matches!(l.try_acquire(&[1, 20]), Err(Deny::Wait(_))));
        assert_eq!(l.available(0), 4.0);
        assert_eq!(l.available(1), 10.0);
        assert!(matches!(l.try_acquire(&[1, 200]), Err(Deny::TooLarge { unit: 1, .. })));
        assert_eq!(l.available(0), 4.0);
    }

    #[test]
    fn hold_until_pauses_one_unit_or_all() {
        let (l, clock) = limiter(&[("requests", 10.0, 5), ("tokens", 100.0, 100)]);
        assert!(l.hold_until(S, Some(1)));
        assert_eq!(l.available(0), 5.0);
        assert!(l.available(1) < 0.0);
        assert!(matches!(l.try_acquire(&[1, 1]), Err(Deny::Wait(_))));
        clock.set(S).unwrap();
        assert!(l.try_acquire(&[1, 1]).is_ok());
        assert!(l.hold_until(2 * S, None));
        assert!(!l.hold_until(2 * S, None));
        assert!(l.try_acquire(&[1, 0]).is_err());
        clock.set(2 * S).unwrap();
        assert!(l.try_acquire(&[1, 1]).is_ok());
    }

    #[test]
    fn reserve_waits_for_the_slowest_rate() {
        let (l, clock) = limiter(&[("requests", 10.0, 1), ("tokens", 100.0, 100)]);
        let r1 = l.reserve(&[1, 100], None).unwrap();
        assert_eq!(r1.delay_ns, 0);
        let r2 = l.reserve(&[1, 50], None).unwrap();
        assert!(r2.delay_ns.abs_diff(500_000_000) <= 1);
        assert!(l.reserve(&[1, 50], Some(100_000_000)).is_err());
        assert_eq!(l.cancel(&r2), 2);
        clock.advance(1_000_000_000).unwrap();
        assert_eq!(l.available(1), 100.0);
    }

    const S: u64 = 1_000_000_000;

    #[test]
    fn multi_rate_give_back_covers_every_rate() {
        let (l, clock) = limiter(&[("requests", 1.0, 10), ("tokens", 1.0, 1)]);
        l.try_acquire(&[1, 1]).unwrap();
        clock.set(S).unwrap();
        let token = Resource::take_at(&l, S, &[1, 1]).unwrap();
        // A later reservation stands on tokens only (requests' word is unchanged).
        assert_eq!(l.reserve(&[0, 1], None).unwrap().delay_ns, S);
        Resource::give_back(&l, &[1, 1], Some(token));
        assert_eq!(l.refunds_dropped(), 1);
        assert_eq!(l.available(0), 10.0); // requests: nothing scheduled ahead, refunded
        assert_eq!(l.reserve(&[0, 1], None).unwrap().delay_ns, 2 * S);
    }

    #[test]
    fn multi_rate_give_back_is_exact_when_nothing_came_after() {
        let (l, clock) = limiter(&[("requests", 1.0, 1), ("tokens", 10.0, 10)]);
        l.try_acquire(&[1, 5]).unwrap();
        clock.set(S).unwrap();
        let token = Resource::take_at(&l, S, &[1, 5]).unwrap();
        Resource::give_back(&l, &[1, 5], Some(token));
        assert_eq!((l.available(0), l.available(1)), (1.0, 10.0));
        assert_eq!(l.refunds_dropped(), 0);
    }

    #[test]
    fn cancel_follows_the_undo_rule_on_every_rate() {
        let (l, _) = limiter(&[("requests", 1.0, 1), ("tokens", 10.0, 10)]);
        let r1 = l.reserve(&[1, 5], None).unwrap();
        l.try_acquire(&[0, 2]).unwrap();
        // requests: still the latest (exact); tokens: not, nothing scheduled ahead (refunded).
        assert_eq!(l.cancel(&r1), 2);
        assert_eq!((l.available(0), l.available(1)), (1.0, 8.0));
        let r2 = l.reserve(&[1, 0], None).unwrap();
        let r3 = l.reserve(&[1, 0], None).unwrap();
        assert_eq!((r2.delay_ns, r3.delay_ns), (0, S));
        // requests: r3 is scheduled ahead (kept, counted); tokens: nothing to give.
        assert_eq!(l.cancel(&r2), 0);
        assert_eq!(l.refunds_dropped(), 1);
        assert_eq!(l.reserve(&[1, 0], None).unwrap().delay_ns, 2 * S);
    }

    #[test]
    fn a_refund_leaves_what_a_grant_another_rate_scheduled_later_stands_on() {
        // requests: one per 0.4 s; tokens: 100 per second, burst 100.
        let clock = Arc::new(ManualClock::new(0).unwrap());
        let rates = vec![
            ("requests".to_string(), Rate::new(5.0, 2e9, 1).unwrap()),
            ("tokens".to_string(), Rate::new(100.0, 1e9, 100).unwrap()),
        ];
        let l = Limiter::new(rates, AnyClock::Manual(clock.clone())).unwrap();
        const MS: u64 = 1_000_000;
        clock.set(1000 * MS).unwrap();
        l.try_acquire(&[1, 39]).unwrap();
        l.reserve(&[1, 30], None).unwrap(); // 1.4 s
        let r2 = l.reserve(&[1, 55], None).unwrap(); // 1.8 s
        clock.set(2000 * MS).unwrap();
        let r3 = l.reserve(&[1, 61], None).unwrap(); // 2.2 s, set by the requests rate
        assert_eq!((r2.at_ns, r3.at_ns), (1800 * MS, 2200 * MS));
        clock.set(2120 * MS).unwrap();
        l.cancel(&r2);
        let r4 = l.reserve(&[1, 82], None).unwrap();
        // 61 + 82 tokens in [r3, r4]: at most 100 + 100 per second.
        let d = (r4.at_ns - r3.at_ns) as f64 / 1e9;
        assert!(143.0 <= 100.0 + 100.0 * d + 1e-6, "{d}");
    }

    #[test]
    fn capacity_given_back_is_ready_no_earlier_than_it_came_back() {
        let (l, clock) = limiter(&[("requests", 5.0, 4)]);
        const MS: u64 = 1_000_000;
        l.try_acquire(&[4]).unwrap();
        let r2 = l.reserve(&[2], None).unwrap(); // 0.4 s
        l.reserve(&[1], None).unwrap(); // 0.6 s
        clock.set(700 * MS).unwrap();
        assert!(l.cancel(&r2) > 0);
        // A waiter that arrived at 0.5 s is not dated before the refund at 0.7 s.
        assert_eq!(Resource::ready_at(&l, 500 * MS, &[1]).unwrap(), Some(700 * MS));
    }

    #[test]
    fn settle_with_a_token_is_exact_while_latest_else_capped() {
        let (l, clock) = limiter(&[("requests", 1.0, 2)]);
        let old = GrantRef {
            at_ns: 0,
            token: l.try_take_token(0, &[1]).unwrap(),
            owed: None,
        };
        clock.set(5 * S).unwrap();
        l.try_acquire(&[1]).unwrap();
        // What time already restored is not refunded again.
        assert_eq!(Resource::settle(&l, &[1], &[0], old).token, None);
        assert_eq!(l.available(0), 1.0);
        let g = GrantRef {
            at_ns: 5 * S,
            token: l.try_take_token(5 * S, &[1]).unwrap(),
            owed: None,
        };
        let g = Resource::settle(&l, &[1], &[3], g);
        assert!(g.token.is_some());
        assert_eq!(l.available(0), -2.0);
        assert!(Resource::settle(&l, &[3], &[0], g).token.is_some());
        assert_eq!(l.available(0), 1.0);
    }

    #[test]
    fn settle_with_a_token_no_longer_latest_refunds_what_the_debit_still_holds() {
        // A later grant sits above the settled one: no exact undo, but the debit still
        // holds all its 5 units (none restored by time yet), so 4 come back, as they
        // would from a reservation's cancel or a settle known by its grant time.
        for rates in [
            &[("tokens", 10.0, 10)][..],
            &[("requests", 100.0, 100), ("tokens", 10.0, 10)][..],
        ] {
            let (l, _) = limiter(rates);
            let n = rates.len();
            let mut cost = vec![1; n];
            cost[n - 1] = 5;
            let g = GrantRef {
                at_ns: 0,
                token: l.try_take_token(0, &cost).unwrap(),
                owed: None,
            };
            l.try_acquire(&vec![1; n]).unwrap();
            assert_eq!(l.available(n - 1), 4.0);
            let mut actual = cost.clone();
            actual[n - 1] = 1;
            assert_eq!(Resource::settle(&l, &cost, &actual, g).token, None);
            assert_eq!(l.available(n - 1), 8.0, "rates {rates:?}");
        }
    }

    #[test]
    fn multi_rate_try_settle_settles_as_settle_unless_the_lock_is_busy() {
        // Twin limiters, the same grants and settles: try_settle (acq10: several rates
        // too, under the multi-rate lock when it is free) gives what settle gives.
        let rates = [("requests", 10.0, 10), ("tokens", 100.0, 100)];
        let (a, _) = limiter(&rates);
        let (b, _) = limiter(&rates);
        let grant = |l: &Limiter| GrantRef {
            at_ns: 0,
            token: l.try_take_token(0, &[1, 50]).unwrap(),
            owed: None,
        };
        let (ga, gb) = (grant(&a), grant(&b));
        let ga = Resource::try_settle(&a, &[1, 50], &[1, 30], ga).unwrap();
        let gb = Resource::settle(&b, &[1, 50], &[1, 30], gb);
        assert_eq!(ga.token.is_some(), gb.token.is_some());
        assert!(ga.token.is_some());
        assert_eq!((a.available(0), a.available(1)), (b.available(0), b.available(1)));
        assert_eq!(a.available(1), 70.0);
        let ga = Resource::try_settle(&a, &[1, 30], &[2, 60], ga).unwrap();
        let gb = Resource::settle(&b, &[1, 30], &[2, 60], gb);
        assert_eq!(ga.token.is_some(), gb.token.is_some());
        assert_eq!((a.available(0), a.available(1)), (8.0, 40.0));
        assert_eq!((b.available(0), b.available(1)), (8.0, 40.0));
        // Busy: nothing changes, the caller settles by the blocking path.
        let busy = a.lock_multi();
        assert!(Resource::try_settle(&a, &[2, 60], &[1, 10], ga).is_none());
        drop(busy);
        assert_eq!((a.available(0), a.available(1)), (8.0, 40.0));
        assert!(Resource::try_settle(&a, &[2, 60], &[1, 10], ga).is_some());
        assert_eq!((a.available(0), a.available(1)), (9.0, 90.0));
    }

    #[test]
    fn a_fork_waits_for_a_grant_being_filed() {
        // A thread stopped while it files a multi-rate grant (the list of recent grants
        // held) must keep the fork handler waiting: in the child that thread is gone, and
        // the list would stay locked for good (the child's next grant would hang).
        use crate::fork::ForkLocks;
        use std::sync::atomic::AtomicBool;
        let (l, _) = limiter(&[("requests", 10.0, 10), ("tokens", 1.0, 2)]);
        let released = AtomicBool::new(false);
        std::thread::scope(|s| {
            let (tx, rx) = std::sync::mpsc::channel();
            let (l, released) = (&l, &released);
            s.spawn(move || {
                let filing = l.hold_grant_list();
                tx.send(()).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(300));
                released.store(true, Ordering::SeqCst);
                drop(filing);
            });
            rx.recv().unwrap();
            let mut held = Vec::new();
            l.lock_for_fork(&mut held);
            assert!(
                released.load(Ordering::SeqCst),
                "the fork handler held the limiter's locks while a grant was being filed"
            );
        });
    }

    #[test]
    fn a_try_does_not_wait_for_a_grant_being_filed() {
        // What a caller holding the GIL uses: busy, it says so (None) and changes nothing.
        let (l, _) = limiter(&[("requests", 10.0, 10), ("tokens", 1.0, 2)]);
        let filing = l.hold_grant_list();
        assert!(Resource::try_take_token_nowait(&l, 0, &[1, 1]).is_none());
        assert!(Resource::try_take_token_idle_nowait(&l, 0, &[1, 1], &|| false).is_none());
        assert!(l.try_acquire_nowait(&[1, 1]).is_none());
        drop(filing);
        assert_eq!((l.available(0), l.available(1)), (10.0, 2.0));
        let token = Resource::try_take_token_nowait(&l, 0, &[1, 1]).unwrap().unwrap();
        assert!(token.is_some());
        Resource::give_back(&l, &[1, 1], token);
        assert_eq!((l.available(0), l.available(1)), (10.0, 2.0));
    }

    #[test]
    fn multi_rate_settle_without_exactness_is_capped_by_the_grant_time() {
        let (l, clock) = limiter(&[("requests", 10.0, 10), ("tokens", 1.0, 2)]);
        let g = GrantRef {
            at_ns: 0,
            token: l.try_take_token(0, &[1, 1]).unwrap(),
            owed: None,
        };
        clock.set(5 * S).unwrap();
        l.try_acquire(&[1, 1]).unwrap();
        let g = Resource::settle(&l, &[1, 1], &[1, 0], g);
        assert_eq!(g.token, None);
        assert_eq!(l.available(1), 1.0);
    }

    #[test]
    fn same_unit_twice_applies_both() {
        let (l, _) = limiter(&[("requests", 10.0, 2), ("requests", 1.0, 3)]);
        assert_eq!(l.units().len(), 1);
        assert!(l.try_acquire(&[2]).is_ok());
        assert!(l.try_acquire(&[1]).is_err());
    }
}

mod epochs {
    use super::super::*;
    use crate::clock::ManualClock;
    use std::sync::Arc;

    #[test]
    fn reserving_beyond_the_range_says_so() {
        let clock = Arc::new(ManualClock::new(1 << 62).unwrap());
        let rate = Rate::new(1.0, 86_400e9, 1).unwrap();
        let l = Limiter::new(vec![("requests".into(), rate)], AnyClock::Manual(clock)).unwrap();
        let e = loop {
            if let Err(e) = l.reserve(&[1], None) {
                break e;
            }
        };
        let Error::Overloaded { reason, retry_after_ns } = e else {
            panic!("{e:?}")
        };
        assert!(reason.contains("beyond the bucket's range"), "{reason}");
        assert!(retry_after_ns > 9 * 365 * 86_400 * 1_000_000_000, "{retry_after_ns}");
    }
}
