//! The gateway's REST API over HTTP with a real ledger, placement and node behind it: E2B's
//! error shape on every bad input, team isolation, no capacity, and the undo of failed creates.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{assert_e2b_error, stack};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_e2b_errors_and_changes_nothing() {
    let s = stack(4096).await;
    let key = Some("key-a");
    let base = Some(r#"{"templateID":"base"}"#);
    assert_e2b_error(&s.call("POST", "/sandboxes", None, base).await, 401);
    assert_e2b_error(&s.call("POST", "/sandboxes", Some("wrong"), base).await, 401);
    assert_e2b_error(&s.call("POST", "/sandboxes", key, Some("{not json")).await, 400);
    assert_e2b_error(
        &s.call("POST", "/sandboxes", key, Some(r#"{"templateID": 5}"#)).await,
        400,
    );
    assert_e2b_error(
        &s.call("POST", "/sandboxes", key, Some(r#"{"templateID":"nope"}"#))
            .await,
        404,
    );
    let negative = Some(r#"{"templateID":"base","timeout":-1}"#);
    assert_e2b_error(&s.call("POST", "/sandboxes", key, negative).await, 400);
    let too_long = Some(r#"{"templateID":"base","timeout":999999}"#);
    assert_e2b_error(&s.call("POST", "/sandboxes", key, too_long).await, 400);
    let huge = format!(
        r#"{{"templateID":"base","metadata":{{"k":"{}"}}}}"#,
        "x".repeat(2 << 20)
    );
    assert_e2b_error(&s.call("POST", "/sandboxes", key, Some(&huge)).await, 413);
    assert_e2b_error(&s.call("GET", "/sandboxes/iunknown", key, None).await, 404);
    assert_e2b_error(&s.call("POST", "/sandboxes/iunknown/pause", key, None).await, 404);
    assert_e2b_error(&s.call("GET", "/sandboxes?metadata=broken", key, None).await, 400);
    // IDs are checked at the edge: 400 naming the field, never a 500 from further in.
    let long = format!("/sandboxes/{}", "a".repeat(600));
    for path in [
        long.as_str(),
        "/sandboxes/a%01b",
        "/sandboxes/a%00b/pause",
        "/sandboxes/.hidden",
    ] {
        for method in ["GET", "POST", "DELETE"] {
            let answer = s.call(method, path, key, None).await;
            assert!(answer.0 == 400 || answer.0 == 405, "{method} {path}: {answer:?}");
            if answer.0 == 400 {
                assert!(
                    answer.1["message"].as_str().unwrap().contains("sandboxID"),
                    "{answer:?}"
                );
            }
        }
    }
    // Sizes are bounded before any arithmetic (2^44 + 256 MB used to wrap to 256 MiB).
    for body in [
        r#"{"templateID":"base","memoryMB":17592186044672}"#,
        r#"{"templateID":"base","memoryMB":18446744073709551615}"#,
        r#"{"templateID":"base","cpuCount":1000000000}"#,
        r#"{"templateID":"base","metadata":{"a\u0000b":"x"}}"#,
        r#"{"templateID":"base","metadata":{"k":"line\u0007"}}"#,
        // A template reference with a control character (schemathesis found it answered 500,
        // the ledger's refusal of the key passed on as a server error).
        r#"{"templateID":"ba\u001cse"}"#,
        r#"{"templateID":"base\u0000"}"#,
    ] {
        assert_e2b_error(&s.call("POST", "/sandboxes", key, Some(body)).await, 400);
    }
    // A body that is not JSON by its content type is refused as such.
    let plain = reqwest::Client::new()
        .post(format!("{}/sandboxes", s.url()))
        .header("X-API-Key", "key-a")
        .header("Content-Type", "text/plain")
        .body(r#"{"templateID":"base"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(plain.status().as_u16(), 415);
    // What is not served yet says so (501), rather than the 404 an SDK reads as "not found".
    for (method, path) in [
        ("GET", "/volumes"),
        // Template builds of SDKs before 2.x.
        ("POST", "/templates"),
        ("POST", "/v2/templates"),
        ("POST", "/templates/base/builds/b"),
    ] {
        let answer = s.call(method, path, key, None).await;
        assert_e2b_error(&answer, 501);
        assert!(
            answer.1["message"].as_str().unwrap().contains("not supported"),
            "{path}"
        );
    }
    // Template requests that are malformed.
    for (method, path, body, status) in [
        ("POST", "/v3/templates", None, 400),
        ("POST", "/v3/templates", Some(r#"{"name": "Bad Name"}"#), 400),
        ("POST", "/v3/templates", Some(r#"{"name": "ok", "cpuCount": 0}"#), 400),
        (
            "POST",
            "/v3/templates",
            Some(r#"{"name": "ok", "tags": ["no spaces"]}"#),
            400,
        ),
        ("GET", "/templates/aliases/a%20b", None, 400),
        ("GET", "/templates/base/files/not-hex", None, 400),
        ("GET", "/templates/nope/builds/b/status", None, 404),
        ("GET", "/templates/base/builds/b/status?limit=101", None, 400),
        (
            "POST",
            "/templates/tags",
            Some(r#"{"target": "base", "tags": []}"#),
            400,
        ),
        ("DELETE", "/templates/base", None, 403),
        ("POST", "/sandboxes/iunknown/fork", None, 404),
        ("POST", "/sandboxes/iunknown/fork", Some(r#"{"count": 0}"#), 400),
        ("POST", "/sandboxes/iunknown/snapshots", None, 404),
        (
            "POST",
            "/sandboxes/iunknown/snapshots",
            Some(r#"{"name": "No Caps"}"#),
            400,
        ),
    ] {
        let answer = s.call(method, path, key, body).await;
        assert_e2b_error(&answer, status);
    }
    let (status, list) = s.call("GET", "/sandboxes", key, None).await;
    assert_eq!((status, list), (200, json!([])), "a refused request created something");
    let (status, templates) = s.call("GET", "/templates", key, None).await;
    assert_eq!(status, 200);
    assert_eq!(templates.as_array().map(Vec::len), Some(1), "only base: {templates}");
    assert_eq!(s.call("GET", "/snapshots", key, None).await, (200, json!([])));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teams_see_only_their_own_and_manifests_carry_memory() {
    let s = stack(4096).await;
    let body = Some(r#"{"templateID":"base","metadata":{"who":"a"}}"#);
    let (status, created) = s.call("POST", "/sandboxes", Some("key-a"), body).await;
    assert_eq!(status, 201, "{created:?}");
    let id = created["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(created["envdVersion"], e2b_gateway::api::ENVD_VERSION);
    // Another team: 404, not 403, on every verb.
    assert_e2b_error(
        &s.call("GET", &format!("/sandboxes/{id}"), Some("key-b"), None).await,
        404,
    );
    assert_e2b_error(
        &s.call("DELETE", &format!("/sandboxes/{id}"), Some("key-b"), None).await,
        404,
    );
    assert_eq!(s.call("GET", "/sandboxes", Some("key-b"), None).await.1, json!([]));
    let (_, detail) = s.call("GET", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    assert_eq!(
        (detail["state"].as_str(), detail["memoryMB"].as_u64()),
        (Some("running"), Some(512))
    );
    // The manifest describes itself: memory bytes > 0 and where the estimate came from.
    let ledger =
        ledger_client::LedgerClient::connect_lazy(&s.ledger.endpoint(), &s.security(stack::Role::Gateway)).unwrap();
    let doc = ledger
        .get::<common::docs::SandboxDoc>(common::docs::SANDBOX_KIND, &id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(doc.value.memory_bytes, common::resources::DEFAULT_MEMORY_BYTES);
    assert_eq!(doc.value.memory_source, common::docs::EstimateSource::Default);

    let (status, _) = s
        .call("POST", &format!("/sandboxes/{id}/pause"), Some("key-a"), None)
        .await;
    assert_eq!(status, 204);
    assert_e2b_error(
        &s.call("POST", &format!("/sandboxes/{id}/pause"), Some("key-a"), None)
            .await,
        409,
    );
    let resume = Some(r#"{"timeout":60}"#);
    let (status, resumed) = s
        .call("POST", &format!("/sandboxes/{id}/resume"), Some("key-a"), resume)
        .await;
    assert_eq!((status, resumed["sandboxID"].as_str()), (201, Some(id.as_str())));
    let (status, _) = s.call("DELETE", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    assert_eq!(status, 204);
    assert_e2b_error(
        &s.call("GET", &format!("/sandboxes/{id}"), Some("key-a"), None).await,
        404,
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_capacity_is_503_and_leaves_nothing_behind() {
    // 600 MiB of node memory: one 512 MiB sandbox fits, the second does not.
    let s = stack(600).await;
    let base = Some(r#"{"templateID":"base"}"#);
    let (status, _) = s.call("POST", "/sandboxes", Some("key-a"), base).await;
    assert_eq!(status, 201);
    let full = s.call("POST", "/sandboxes", Some("key-a"), base).await;
    assert_e2b_error(&full, 503);
    assert!(full.1["message"].as_str().unwrap().contains("memory"), "{full:?}");
    // "Not now" says when to try again.
    let raw = reqwest::Client::new()
        .post(format!("{}/sandboxes", s.url()))
        .header("X-API-Key", "key-a")
        .header("Content-Type", "application/json")
        .body(r#"{"templateID":"base"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 503);
    assert_eq!(raw.headers().get("retry-after").unwrap(), "1");
    // Larger than any node could ever hold: a 400 saying so, not "try again".
    let never = s
        .call(
            "POST",
            "/sandboxes",
            Some("key-a"),
            Some(r#"{"templateID":"base","memoryMB":4096}"#),
        )
        .await;
    assert_e2b_error(&never, 400);
    assert!(
        never.1["message"].as_str().unwrap().contains("larger than any node"),
        "{never:?}"
    );
    let (_, list) = s.call("GET", "/sandboxes", Some("key-a"), None).await;
    assert_eq!(list.as_array().unwrap().len(), 1, "the failed create left a manifest");
    let ledger =
        ledger_client::LedgerClient::connect_lazy(&s.ledger.endpoint(), &s.security(stack::Role::Gateway)).unwrap();
    let (docs, _) = ledger.list::<Value>(common::docs::SANDBOX_KIND, "").await.unwrap();
    assert_eq!(docs.len(), 1);
    let id = list[0]["sandboxID"].as_str().unwrap().to_string();
    s.call("DELETE", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_ends_sandboxes_at_their_timeout() {
    let s = stack(4096).await;
    let body = Some(r#"{"templateID":"base","timeout":1}"#);
    let (_, created) = s.call("POST", "/sandboxes", Some("key-a"), body).await;
    let id = created["sandboxID"].as_str().unwrap().to_string();
    let mut gone = false;
    for _ in 0..100 {
        if s.call("GET", &format!("/sandboxes/{id}"), Some("key-a"), None).await.0 == 404 {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "the sandbox outlived its timeout");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_is_counted_by_every_service() {
    let handle = common::metrics::recorder().expect("the only recorder of this test process");
    let s = stack(4096).await;
    let (status, created) = s
        .call("POST", "/sandboxes", Some("key-a"), Some(r#"{"templateID":"base"}"#))
        .await;
    assert_eq!(status, 201);
    let text = handle.render();
    for name in [
        "gateway_http_requests_total",
        "gateway_http_request_duration_seconds_bucket",
        "placement_places_total{outcome=\"placed\"}",
        "placement_place_duration_seconds_bucket",
        "ledger_compares_total{outcome=\"committed\"}",
        "node_lifecycle_duration_seconds_bucket{op=\"create\"",
    ] {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
    let id = created["sandboxID"].as_str().unwrap();
    s.call("DELETE", &format!("/sandboxes/{id}"), Some("key-a"), None).await;
    s.stop().await;
}

/// A create retried with the same Idempotency-Key makes one sandbox, however the retries
/// race; the key with another request is refused; a malformed key is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_with_an_idempotency_key_happens_once() {
    let s = stack(4096).await;
    let create = |key: &'static str, body: &'static str| {
        let url = format!("{}/sandboxes", s.url());
        async move {
            let r = reqwest::Client::new()
                .post(url)
                .header("X-API-Key", "key-a")
                .header("Content-Type", "application/json")
                .header("Idempotency-Key", key)
                .body(body)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<serde_json::Value>().await.unwrap_or_default())
        }
    };
    let body = r#"{"templateID":"base","metadata":{"try":"1"}}"#;
    let (a, b, c) = tokio::join!(
        create("retry-key-1", body),
        create("retry-key-1", body),
        create("retry-key-1", body)
    );
    for answer in [&a, &b, &c] {
        assert_eq!(answer.0, 201, "{answer:?}");
    }
    assert_eq!(a.1["sandboxID"], b.1["sandboxID"]);
    assert_eq!(a.1["sandboxID"], c.1["sandboxID"]);
    let (_, list) = s.call("GET", "/sandboxes", Some("key-a"), None).await;
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    // The same key for another request is a conflict; another team's key space is its own.
    let other = create("retry-key-1", r#"{"templateID":"base"}"#).await;
    assert_e2b_error(&other, 409);
    let fresh = create("retry-key-2", body).await;
    assert_eq!(fresh.0, 201);
    assert_ne!(fresh.1["sandboxID"], a.1["sandboxID"]);
    assert_e2b_error(&create("Not_A_Key", body).await, 400);
    s.stop().await;
}

/// Listing: newest first (or `order=asc`), pages that continue where the last ended
/// (`x-next-token`), `startedAfter` and `template` filters; bad values are 400s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_are_ordered_paged_and_filtered() {
    let s = stack(4096).await;
    let mut made = Vec::new();
    for i in 0..3 {
        let body = format!(r#"{{"templateID":"base","metadata":{{"n":"{i}"}}}}"#);
        let (status, created) = s.call("POST", "/sandboxes", Some("key-a"), Some(&body)).await;
        assert_eq!(status, 201, "{created}");
        made.push(created["sandboxID"].as_str().unwrap().to_string());
        // Distinct start times, so the order is the creation order.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let ids = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|d| d["sandboxID"].as_str().unwrap().to_string())
            .collect()
    };
    let (_, newest) = s.call("GET", "/v2/sandboxes", Some("key-a"), None).await;
    let mut expected: Vec<String> = made.iter().rev().cloned().collect();
    assert_eq!(ids(&newest), expected, "newest first");
    let (_, oldest) = s.call("GET", "/v2/sandboxes?order=asc", Some("key-a"), None).await;
    expected.reverse();
    assert_eq!(ids(&oldest), expected);
    // One a page, following the token.
    let (mut paged, mut token) = (Vec::new(), None::<String>);
    loop {
        let url = match &token {
            None => format!("{}/v2/sandboxes?limit=1", s.url()),
            Some(t) => format!("{}/v2/sandboxes?limit=1&nextToken={t}", s.url()),
        };
        let r = reqwest::Client::new()
            .get(url)
            .header("X-API-Key", "key-a")
            .send()
            .await
            .unwrap();
        token = r.headers().get("x-next-token").map(|v| v.to_str().unwrap().to_string());
        paged.extend(ids(&r.json::<Value>().await.unwrap()));
        if token.is_none() {
            break;
        }
    }
    assert_eq!(paged, made.iter().rev().cloned().collect::<Vec<_>>());
    // Filters.
    let (_, detail) = s
        .call("GET", &format!("/sandboxes/{}", made[1]), Some("key-a"), None)
        .await;
    let since = detail["startedAt"].as_str().unwrap().to_string();
    let (_, recent) = s
        .call(
            "GET",
            &format!("/v2/sandboxes?order=asc&startedAfter={since}"),
            Some("key-a"),
            None,
        )
        .await;
    assert_eq!(ids(&recent), made[1..].to_vec());
    let (_, base) = s.call("GET", "/v2/sandboxes?template=base", Some("key-a"), None).await;
    assert_eq!(ids(&base).len(), 3);
    let (_, other) = s
        .call("GET", "/v2/sandboxes?template=python", Some("key-a"), None)
        .await;
    assert_eq!(other, json!([]));
    for bad in ["order=sideways", "startedAfter=yesterday", "nextToken=nope", "limit=0"] {
        assert_e2b_error(
            &s.call("GET", &format!("/v2/sandboxes?{bad}"), Some("key-a"), None)
                .await,
            400,
        );
    }
    s.stop().await;
}

/// Nodes are the cluster's, not a tenant's: E2B's admin routes take the operators' token
/// (`X-Admin-Token`) and no team's API key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_are_for_operators_only() {
    let s = stack(1024).await;
    let node_id = s.nodes[0].id.clone();
    for path in ["/nodes".to_string(), format!("/nodes/{node_id}")] {
        let (status, body) = s.call("GET", &path, Some("key-a"), None).await;
        assert_eq!(status, 401, "a team's API key read {path}: {body}");
        assert!(body["message"].as_str().unwrap().contains("X-Admin-Token"), "{body}");
        for token in ["wrong", "", &support::ADMIN_TOKEN[..support::ADMIN_TOKEN.len() - 1]] {
            let r = reqwest::Client::new()
                .get(format!("{}{path}", s.url()))
                .header("X-Admin-Token", token)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 401, "token {token:?} read {path}");
        }
        let r = reqwest::Client::new()
            .get(format!("{}{path}", s.url()))
            .header("X-Admin-Token", support::ADMIN_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200, "the operator was refused {path}");
    }
}

/// One team holds at most its limit of sandboxes at once (E2B's concurrency limit): past it a
/// create is answered 429 in E2B's shape and nothing is made, while another team still
/// creates; a kill gives the room back at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_holds_at_most_its_limit_and_leaves_the_rest_to_others() {
    let nodes = stack::Stack::builder().node(|_| {});
    let s = support::started(nodes, |c| {
        c.keys.insert("key-b".to_string(), "team-b".to_string());
        c.max_sandboxes_per_team = 2;
    })
    .await;
    let body = Some(r#"{"templateID":"base"}"#);
    // Four at once for two places: concurrent creates through one gateway do not overshoot.
    let racing = futures::future::join_all((0..4).map(|_| s.call("POST", "/sandboxes", Some("key-a"), body))).await;
    let held: Vec<String> = racing
        .iter()
        .filter(|(status, _)| *status == 201)
        .map(|(_, made)| made["sandboxID"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(held.len(), 2, "{racing:?}");
    for refused in racing.iter().filter(|(status, _)| *status != 201) {
        assert_e2b_error(refused, 429);
        assert!(
            refused.1["message"].as_str().unwrap_or_default().contains("(2)"),
            "{}",
            refused.1
        );
    }
    let (_, listed) = s.call("GET", "/sandboxes", Some("key-a"), None).await;
    assert_eq!(
        listed.as_array().map(Vec::len),
        Some(2),
        "the refused creates made nothing"
    );
    // Another team is not held to team-a's count.
    assert_eq!(s.call("POST", "/sandboxes", Some("key-b"), body).await.0, 201);
    // A kill gives the room back (at once on this gateway; the test allows the watch a moment).
    let (status, _) = s
        .call("DELETE", &format!("/sandboxes/{}", held[0]), Some("key-a"), None)
        .await;
    assert_eq!(status, 204);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (status, answer) = s.call("POST", "/sandboxes", Some("key-a"), body).await;
        if status == 201 {
            break;
        }
        assert_e2b_error(&(status, answer), 429);
        assert!(
            tokio::time::Instant::now() < deadline,
            "the killed sandbox's room never came back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A hibernated sandbox holds no room (its files only), and waking it takes some again:
    // within the limit, or hibernating would be a way around it.
    let path = format!("/sandboxes/{}/pause", held[1]);
    let (status, answer) = s.call("POST", &path, Some("key-a"), Some(r#"{"memory":false}"#)).await;
    assert_eq!(status, 204, "{answer}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while s.call("POST", "/sandboxes", Some("key-a"), body).await.0 != 201 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the hibernated sandbox's room never came back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let path = format!("/sandboxes/{}/resume", held[1]);
    let refused = s.call("POST", &path, Some("key-a"), Some(r#"{"timeout":60}"#)).await;
    assert_e2b_error(&refused, 429);
    s.stop().await;
}
