//! `pools` and `pool TEMPLATE SIZE`: templates' warm pools, read and sized in the ledger
//! directly (the operator may write any document). Every gateway's keeper follows the
//! ledger, so a size set here is filled or emptied within a keeper round.

use anyhow::Context;
use common::pool::{PoolDoc, PoolSlotDoc, MAX_POOL_SIZE, POOL_KIND, POOL_SLOT_KIND};
use common::template::{TemplateDoc, TemplateNameDoc, TEMPLATE_KIND, TEMPLATE_NAME_KIND};
use ledger_client::{LedgerClient, LedgerError, Txn};
use serde_json::json;

use crate::table::Table;

/// Every pool: its size, and its slots by what their sandboxes are.
pub async fn list(ledger: &LedgerClient, as_json: bool) -> anyhow::Result<()> {
    let (pools, _) = ledger.list::<PoolDoc>(POOL_KIND, "").await?;
    let (slots, _) = ledger.list::<PoolSlotDoc>(POOL_SLOT_KIND, "").await?;
    let mut t = Table::new(&["template", "size", "slots_taken", "set_by"]);
    for pool in pools {
        let taken = slots
            .iter()
            .filter(|s| s.value.template_id == pool.value.template_id)
            .count();
        t.row(vec![
            json!(pool.value.template_id),
            json!(pool.value.size),
            json!(taken),
            json!(pool.value.set_by),
        ]);
    }
    t.print(as_json);
    Ok(())
}

/// Sets the pool of the template with this ID or name to `size`.
pub async fn set(ledger: &LedgerClient, template: &str, size: u32) -> anyhow::Result<()> {
    anyhow::ensure!(
        size <= MAX_POOL_SIZE,
        "size {size} exceeds the largest pool, {MAX_POOL_SIZE}"
    );
    let template_id = match ledger.get::<TemplateDoc>(TEMPLATE_KIND, template).await? {
        Some(doc) => doc.value.template_id,
        None => {
            ledger
                .get::<TemplateNameDoc>(TEMPLATE_NAME_KIND, template)
                .await?
                .with_context(|| format!("no template has the ID or name {template:?}"))?
                .value
                .template_id
        }
    };
    let doc = PoolDoc {
        template_id: template_id.clone(),
        size,
        set_by: common::pool::OPERATOR.into(),
        updated_at_unix_ms: common::clock::now_ms(),
    };
    for _ in 0..5 {
        let txn = match ledger.get::<PoolDoc>(POOL_KIND, &template_id).await? {
            Some(current) => Txn::new().update_read(&current, &doc)?,
            None => Txn::new().create(POOL_KIND, &template_id, &doc)?,
        };
        match ledger.compare(txn).await {
            Ok(_) => {
                println!("pool of {template_id}: {size}");
                return Ok(());
            }
            Err(LedgerError::Conflict { .. }) => continue,
            Err(err) => return Err(err.into()),
        }
    }
    anyhow::bail!("the pool of {template_id} kept changing; try again")
}
